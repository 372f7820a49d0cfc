/* rowdot: y = x @ w^T + bias in fp32, each output element computed the same way whatever the
 * call's row count, the element's row, or the other rows' values (batch invariant by
 * construction, not by a probe). Built and loaded by actors/rowdot.py.
 *
 * y[i][j] is one LANES-lane accumulator running over k = 0, LANES, 2 LANES, ... in order (lane l
 * holds the products of k = l mod LANES, each added with one fused multiply-add on the AVX2
 * build (8 lanes) and the AVX-512 build (16 lanes), or one multiply then one add on the portable
 * build (8 lanes)), then the lanes summed in one fixed order, then the K % LANES tail in order,
 * then the bias. The builds' bits differ from each other (lanes, roundings), never within one. Blocks of rows and columns only share loads:
 * every element keeps its own accumulator, so the blocking (chosen from M for speed) does not
 * change any bit.
 *
 * Shapes: x (M, K), w (N, K), bias (N) or NULL, all contiguous; y rows ldy apart (ldy >= N,
 * so a caller can hand threads column ranges of one output).
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

/* The 8 lane sums added in one fixed order: (0+4, 2+6), (1+5, 3+7), as the AVX2 build's vsum
 * pairs them (the portable build's vsum and rowdot_ssd_update's readout call this). */
static inline float pair8(const float a[8]) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

#if defined(__AVX512F__) && !defined(ROWDOT_PORTABLE)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, acc) _mm512_fmadd_ps((a), (b), (acc))
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VBCAST(p) _mm512_set1_ps(*(p))
#define PFMA VFMA
#define PANEL_ROWS 8 /* 16 accumulators of the 32 registers */
static inline float vsum(vec v) { /* halves, then the AVX2 build's pairing of the 8 sums */
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
const char *rowdot_variant(void) { return "avx512f"; }
#elif defined(__AVX2__) && defined(__FMA__) && !defined(ROWDOT_PORTABLE)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, acc) _mm256_fmadd_ps((a), (b), (acc))
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VBCAST(p) _mm256_broadcast_ss(p)
#define PFMA VFMA
#define PANEL_ROWS 6 /* 12 accumulators, 2 weight vectors and a broadcast: 15 of the 16 registers */
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
const char *rowdot_variant(void) { return "avx2+fma"; }
#else
#define LANES 8
typedef float vec __attribute__((vector_size(32)));
static inline vec VZERO(void) { vec z = {0}; return z; }
static inline vec VLOAD(const float *p) { vec v; __builtin_memcpy(&v, p, sizeof v); return v; }
#define VFMA(a, b, acc) ((acc) + (a) * (b)) /* built with -ffp-contract=off: two roundings */
static inline void VSTORE(float *p, vec v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vec VBCAST(const float *p) { vec v = {*p, *p, *p, *p, *p, *p, *p, *p}; return v; }
static inline vec PFMA(vec a, vec b, vec acc) { /* one rounding a lane, as the vector builds' */
  for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[l], b[l], acc[l]);
  return acc;
}
#define PANEL_ROWS 6
static inline float vsum(vec v) { /* the same pairing as the AVX2 build's */
  float a[8];
  __builtin_memcpy(a, &v, sizeof a);
  return pair8(a);
}
const char *rowdot_variant(void) { return "portable"; }
#endif

typedef void (*block_fn)(const float *, const float *, long, const float *, float *, long);

/* An R x C block: rows x[0..R), weight rows w[0..C), outputs y[r * ldy + c]. */
#define BLOCK(R, C)                                                                          \
  static void block_##R##x##C(const float *x, const float *w, long K, const float *bias,    \
                              float *y, long ldy) {                                         \
    vec acc[R][C];                                                                          \
    long k = 0, K8 = K - K % LANES;                                                         \
    for (int r = 0; r < R; r++)                                                             \
      for (int c = 0; c < C; c++) acc[r][c] = VZERO();                                      \
    for (; k < K8; k += LANES) {                                                            \
      vec wv[C];                                                                            \
      for (int c = 0; c < C; c++) wv[c] = VLOAD(w + c * K + k);                             \
      for (int r = 0; r < R; r++) {                                                         \
        vec xv = VLOAD(x + r * K + k);                                                      \
        for (int c = 0; c < C; c++) acc[r][c] = VFMA(xv, wv[c], acc[r][c]);                 \
      }                                                                                     \
    }                                                                                       \
    for (int r = 0; r < R; r++)                                                             \
      for (int c = 0; c < C; c++) {                                                         \
        float s = vsum(acc[r][c]);                                                          \
        for (long t = K8; t < K; t++) s += x[r * K + t] * w[c * K + t];                     \
        y[r * ldy + c] = bias ? s + bias[c] : s;                                            \
      }                                                                                     \
  }
BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1)
BLOCK(1, 4) BLOCK(2, 4) BLOCK(3, 4)
BLOCK(1, 8)

#define CHUNK_ROWS 48 /* rows whose x stays in L2 while the weight streams past them once */

/* Rows x columns per block, by the call's rows: one row streams 8 weight rows at a time; more
   rows reuse each weight load across 2 or 3 rows (measured fastest on an AMD EPYC Zen 2). */
static void run_rows(const float *x, const float *w, const float *bias, float *y, long M,
                     long N, long K, long ldy) {
  static const block_fn one_col[3] = {block_1x1, block_2x1, block_3x1};
  static const block_fn four_col[3] = {block_1x4, block_2x4, block_3x4};
  long rows = M >= 3 ? 3 : M, cols = M == 1 ? 8 : 4;
  for (long j = 0; j < N; j += cols) {
    long C = N - j < cols ? N - j : cols;
    const float *wj = w + j * K, *bj = bias ? bias + j : NULL;
    for (long i = 0; i < M; i += rows) {
      long R = M - i < rows ? M - i : rows;
      const float *xi = x + i * K;
      float *yij = y + i * ldy + j;
      if (C == cols)
        (cols == 8 ? block_1x8 : four_col[R - 1])(xi, wj, K, bj, yij, ldy);
      else
        for (long c = 0; c < C; c++) one_col[R - 1](xi, wj + c * K, K, bj ? bj + c : NULL, yij + c, ldy);
    }
  }
}

void rowdot_linear(const float *x, const float *w, const float *bias, float *y, long M, long N,
                   long K, long ldy) {
  for (long i = 0; i < M; i += CHUNK_ROWS) {
    long rows = M - i < CHUNK_ROWS ? M - i : CHUNK_ROWS;
    run_rows(x + i * K, w, bias, y + i * ldy, rows, N, K, ldy);
  }
}

/* rowdot_panel_linear: the same product with no sum across lanes. The weight comes packed in
 * panels of PANEL_COLS columns (`actors.rowdot.pack_panels`): panel p holds columns
 * [p * PANEL_COLS, (p + 1) * PANEL_COLS) as K rows of PANEL_COLS (k-major), the last panel
 * zero-padded. Each output element is one lane of an accumulator that starts at 0 and takes
 * k = 0, 1, ..., K - 1 in order, one fused multiply-add each (one rounding), then the bias.
 * That order involves no other element, row or lane, so a row's bits depend on nothing but
 * the row and the weight, and are the same on every build (AVX-512, AVX2 and the portable
 * build's fmaf agree bit for bit). A block of up to PANEL_ROWS rows shares each weight load;
 * calls go by chunks of CHUNK_ROWS rows, each streaming the weight once.
 *
 * Shapes: x (M, K) contiguous, wp the packed panels of columns [0, N), bias (N) or NULL, y rows
 * ldy apart. A caller splitting columns among threads starts each range on a panel. */
#define PANEL_VECS 2
#define PANEL_COLS (PANEL_VECS * LANES)
#define ACC_DECL(r) vec a##r##0 = VZERO(), a##r##1 = VZERO();
#define ACC_STEP(r) { vec xb = VBCAST(x + r * K + k); a##r##0 = PFMA(xb, w0, a##r##0); \
                      a##r##1 = PFMA(xb, w1, a##r##1); }
#define ACC_STORE(r) VSTORE(out + r * ldo, a##r##0); VSTORE(out + r * ldo + LANES, a##r##1);
#define ROWS1(M) M(0)
#define ROWS2(M) ROWS1(M) M(1)
#define ROWS3(M) ROWS2(M) M(2)
#define ROWS4(M) ROWS3(M) M(3)
#define ROWS5(M) ROWS4(M) M(4)
#define ROWS6(M) ROWS5(M) M(5)
#define ROWS7(M) ROWS6(M) M(6)
#define ROWS8(M) ROWS7(M) M(7)
/* R rows of x times one panel: out (R, PANEL_COLS) rows ldo apart, accumulators in named
 * registers. */
#define PANEL_BLOCK(R)                                                                       \
  static void panel_##R(const float *x, long K, const float *wp, float *out, long ldo) {       \
    ROWS##R(ACC_DECL)                                                                        \
    for (long k = 0; k < K; k++) {                                                           \
      vec w0 = VLOAD(wp + k * PANEL_COLS), w1 = VLOAD(wp + k * PANEL_COLS + LANES);          \
      ROWS##R(ACC_STEP)                                                                      \
    }                                                                                        \
    ROWS##R(ACC_STORE)                                                                       \
  }
PANEL_BLOCK(1) PANEL_BLOCK(2) PANEL_BLOCK(3) PANEL_BLOCK(4) PANEL_BLOCK(5) PANEL_BLOCK(6)
#if PANEL_ROWS == 8
PANEL_BLOCK(7) PANEL_BLOCK(8)
#endif
typedef void (*panel_fn)(const float *, long, const float *, float *, long);

long rowdot_panel_cols(void) { return PANEL_COLS; }

void rowdot_panel_linear(const float *x, const float *wp, const float *bias, float *y, long M, long N,
                         long K, long ldy) {
#if PANEL_ROWS == 8
  static const panel_fn blocks[8] = {panel_1, panel_2, panel_3, panel_4, panel_5, panel_6, panel_7, panel_8};
#else
  static const panel_fn blocks[6] = {panel_1, panel_2, panel_3, panel_4, panel_5, panel_6};
#endif
  float out[PANEL_ROWS * PANEL_COLS];
  long panels = (N + PANEL_COLS - 1) / PANEL_COLS;
  for (long i0 = 0; i0 < M; i0 += CHUNK_ROWS) {
    long i1 = M - i0 < CHUNK_ROWS ? M : i0 + CHUNK_ROWS;
    for (long p = 0; p < panels; p++) {
      long c0 = p * PANEL_COLS, C = N - c0 < PANEL_COLS ? N - c0 : PANEL_COLS;
      for (long i = i0; i < i1; i += PANEL_ROWS) {
        long R = i1 - i < PANEL_ROWS ? i1 - i : PANEL_ROWS;
        if (C == PANEL_COLS && !bias) { /* a whole panel: stored in place */
          blocks[R - 1](x + i * K, K, wp + p * K * PANEL_COLS, y + i * ldy + c0, ldy);
          continue;
        }
        blocks[R - 1](x + i * K, K, wp + p * K * PANEL_COLS, out, PANEL_COLS);
        for (long r = 0; r < R; r++)
          for (long c = 0; c < C; c++)
            y[(i + r) * ldy + c0 + c] = bias ? out[r * PANEL_COLS + c] + bias[c0 + c] : out[r * PANEL_COLS + c];
      }
    }
  }
}

/* rowdot_ssd_update: one decode token of the SSD recurrence for R requests, in one pass over each
 * request's state (the torch path reads it three times: decay, update, readout). For request r
 * (its state at slots[r]), head h (of group g = h / (H / G)) and row p:
 *   s[n] = s[n] * decay[r][h] + B[r][g][n] * xdt[r][h][p]    (two products, one add)
 *   y[r][h][p] = the sum over n of C[r][g][n] * s[n]          (the updated s)
 * The sum runs in 8 lanes (lane l holds n = l mod 8, in order), the lanes added by pair8, then
 * the N % 8 tail in order. Plain C built with -ffp-contract=off: no fused multiply-add, so
 * every build (AVX-512, AVX2, portable) gives the same bits, and a request's bits depend on
 * nothing but its own state and inputs.
 *
 * Shapes: state (S, H, P, N) contiguous, slots (R) distinct, decay (R, H), xdt (R, H, P),
 * B and C (R, G, N), y (R, H, P); all fp32 but slots (int64). */
void rowdot_ssd_update(float *state, const long *slots, long R, long H, long P, long N, long G,
                       const float *decay, const float *xdt, const float *B, const float *C,
                       float *y) {
  long heads_per_group = H / G, N8 = N - N % 8;
  for (long r = 0; r < R; r++) {
    float *sr = state + slots[r] * H * P * N;
    for (long h = 0; h < H; h++) {
      float d = decay[r * H + h];
      const float *b = B + (r * G + h / heads_per_group) * N;
      const float *c = C + (r * G + h / heads_per_group) * N;
      for (long p = 0; p < P; p++) {
        float xv = xdt[(r * H + h) * P + p], acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float *s = sr + (h * P + p) * N;
        long n = 0;
        for (; n < N8; n += 8)
          for (int l = 0; l < 8; l++) {
            float v = s[n + l] * d + b[n + l] * xv;
            s[n + l] = v;
            acc[l] += c[n + l] * v;
          }
        float t = pair8(acc);
        for (; n < N; n++) {
          float v = s[n] * d + b[n] * xv;
          s[n] = v;
          t += c[n] * v;
        }
        y[(r * H + h) * P + p] = t;
      }
    }
  }
}

/* rowdot_conv_update: one decode token of the causal depthwise conv for R requests, and the
 * shift of each request's conv state, in one pass. For request r (its state at slots[r], the last
 * K-1 inputs, oldest first) and channel d:
 *   out[r][d] = s[0] w[0] + s[1] w[1] + ... + s[K-2] w[K-2] + x[r][d] w[K-1] (+ bias[d])
 * summed in that order, one product then one add each (the order and roundings of the torch path,
 * `actors.mamba.causal_conv_step`: the same bits), then s = [s[1], ..., s[K-2], x].
 *
 * Shapes: state (S, D, K-1) contiguous, slots (R), x (R, D), taps (K, D) (the weight
 * transposed), bias (D) or NULL, out (R, D); all fp32 but slots (int64). */
/* The usual d_conv = 4 (three state columns), one request: each channel's sum in the same order
 * as below, written out so that the compiler vectorizes across channels (restrict: no overlap). */
static void conv_update_k4(float *restrict s, const float *restrict x, const float *restrict taps,
                           const float *restrict bias, float *restrict out, long D) {
  const float *t0 = taps, *t1 = taps + D, *t2 = taps + 2 * D, *t3 = taps + 3 * D;
  if (bias)
    for (long d = 0; d < D; d++) {
      float s0 = s[3 * d], s1 = s[3 * d + 1], s2 = s[3 * d + 2], xv = x[d];
      out[d] = (((s0 * t0[d] + s1 * t1[d]) + s2 * t2[d]) + xv * t3[d]) + bias[d];
      s[3 * d] = s1, s[3 * d + 1] = s2, s[3 * d + 2] = xv;
    }
  else
    for (long d = 0; d < D; d++) {
      float s0 = s[3 * d], s1 = s[3 * d + 1], s2 = s[3 * d + 2], xv = x[d];
      out[d] = ((s0 * t0[d] + s1 * t1[d]) + s2 * t2[d]) + xv * t3[d];
      s[3 * d] = s1, s[3 * d + 1] = s2, s[3 * d + 2] = xv;
    }
}

void rowdot_conv_update(float *state, const long *slots, long R, long D, long K, const float *x,
                        const float *taps, const float *bias, float *out) {
  for (long r = 0; r < R; r++) {
    float *sr = state + slots[r] * D * (K - 1);
    const float *xr = x + r * D;
    if (K == 4) {
      conv_update_k4(sr, xr, taps, bias, out + r * D, D);
      continue;
    }
    for (long d = 0; d < D; d++) {
      float *s = sr + d * (K - 1), o = s[0] * taps[d];
      for (long k = 1; k < K - 1; k++) o = o + s[k] * taps[k * D + d];
      o = o + xr[d] * taps[(K - 1) * D + d];
      if (bias) o = o + bias[d];
      out[r * D + d] = o;
      for (long k = 0; k < K - 2; k++) s[k] = s[k + 1];
      s[K - 2] = xr[d];
    }
  }
}

/* rowdot_conv_prefill: the causal depthwise conv over a prefill's L rows, in one pass. window
 * (K-1+L, D) is time-major: the K-1 inputs before the first row, then the L rows. For row t and
 * channel d:
 *   out[t][d] = w[t][d] t[0][d] + w[t+1][d] t[1][d] + ... + w[t+K-1][d] t[K-1][d] (+ bias[d])
 * summed in that order, one product then one add each: the order and roundings of the fp32 CPU
 * torch path (`actors.mamba.causal_conv_prefill`), so its bits, on every build (no fused
 * multiply-adds here). A row's result depends on its own window rows only.
 *
 * Shapes: window (K-1+L, D) with rows ld apart (ld >= D: rows of a wider projection), taps (K, D)
 * (the weight transposed), bias (D) or NULL, out (L, D); all fp32, each row contiguous. */
/* The usual d_conv = 4, written out so that the compiler vectorizes across channels. */
static void conv_prefill_k4(const float *restrict w, long ld, long L, long D, const float *restrict taps,
                            const float *restrict bias, float *restrict out) {
  const float *t0 = taps, *t1 = taps + D, *t2 = taps + 2 * D, *t3 = taps + 3 * D;
  for (long t = 0; t < L; t++) {
    const float *w0 = w + t * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
    float *o = out + t * D;
    if (bias)
      for (long d = 0; d < D; d++)
        o[d] = (((w0[d] * t0[d] + w1[d] * t1[d]) + w2[d] * t2[d]) + w3[d] * t3[d]) + bias[d];
    else
      for (long d = 0; d < D; d++)
        o[d] = ((w0[d] * t0[d] + w1[d] * t1[d]) + w2[d] * t2[d]) + w3[d] * t3[d];
  }
}

void rowdot_conv_prefill(const float *window, long ld, long L, long D, long K, const float *taps,
                         const float *bias, float *out) {
  if (K == 4) {
    conv_prefill_k4(window, ld, L, D, taps, bias, out);
    return;
  }
  for (long t = 0; t < L; t++)
    for (long d = 0; d < D; d++) {
      float o = window[t * ld + d] * taps[d];
      for (long k = 1; k < K; k++) o = o + window[(t + k) * ld + d] * taps[k * D + d];
      if (bias) o = o + bias[d];
      out[t * D + d] = o;
    }
}

/* rowdot_ssd_carry: a chunked SSD scan's recurrence over chunk boundaries, in one pass per chunk.
 * states (C+1, G, N, K, P) holds the state entering chunk 0 in its first entry; for each chunk k
 *   states[k+1] = states[k] * decay[k][g][h] + local[k]      (h: the head within its group)
 * one product then one add per element: the torch path's order and roundings
 * (`actors.mamba._carry_states`), so its bits, on every build.
 *
 * Shapes: states (C+1, G, N, K, P), local (C, G, N, K, P), decay (C, G, K); fp32, contiguous. */
static void carry_row(const float *restrict s, const float *restrict l, float d, float *restrict o,
                      long P) {
  for (long p = 0; p < P; p++) o[p] = s[p] * d + l[p];
}

void rowdot_ssd_carry(float *states, const float *local, const float *decay, long C, long G, long N,
                      long K, long P) {
  long E = G * N * K * P;
  for (long k = 0; k < C; k++) {
    const float *s = states + k * E, *l = local + k * E, *dk = decay + k * G * K;
    float *o = states + (k + 1) * E;
    for (long g = 0; g < G; g++)
      for (long n = 0; n < N; n++)
        for (long h = 0; h < K; h++) {
          long at = ((g * N + n) * K + h) * P;
          carry_row(s + at, l + at, dk[g * K + h], o + at, P);
        }
  }
}

/* rowdot_rms_norm: RMSNorm of each row in one pass, its mean square summed in one fixed order
 * that no build, thread count or row count changes, and that torch ops can repeat (ATen's mean
 * sums in an order of its own). For a row x of n elements:
 *   - the squares x[i] * x[i], zero-padded to m = ceil(n / 16) blocks of 16;
 *   - while m > 1: a zero block appended when m is odd, then block b += block b + m/2 for each
 *     b < m/2, and m = m/2 (elementwise over the 16 lanes);
 *   - then the lanes by halves: lane l += lane l + 8, + 4, + 2, + 1;
 *   - inv = 1 / sqrt(sum * inv_n + eps) (inv_n = fp32(1/n));
 *   - y[i] = x[i] * inv, then with a weight w[i] * y[i], or y[i] * (1 + w[i]) (`offset`).
 * Every step is one IEEE product or sum, rounded (no fused multiply-add: -ffp-contract=off), so
 * the torch path of `actors.norms` (the same steps as tensor ops, `tree_inv_rms`) gives the same
 * bits. Row r takes the weight's part (r % wrap) * n (a gated norm's groups: wrap = groups).
 *
 * Shapes: x and out (R, n) contiguous fp32 (out may be x), w (wrap * n) fp32 or NULL. Returns
 * nonzero when the scratch for a long row cannot be had. */
#define RMS_LANES 16
#define RMS_STACK_BLOCKS 257

static float tree_sum_squares(const float *restrict x, long n, float *restrict buf) {
  long m = (n + RMS_LANES - 1) / RMS_LANES;
  for (long i = 0; i < n; i++) buf[i] = x[i] * x[i];
  for (long i = n; i < m * RMS_LANES; i++) buf[i] = 0.0f;
  while (m > 1) {
    if (m & 1) {
      for (long l = 0; l < RMS_LANES; l++) buf[m * RMS_LANES + l] = 0.0f;
      m++;
    }
    long half = m / 2, off = half * RMS_LANES;
    for (long i = 0; i < off; i++) buf[i] = buf[i] + buf[i + off];
    m = half;
  }
  for (long w = RMS_LANES / 2; w >= 1; w /= 2)
    for (long l = 0; l < w; l++) buf[l] = buf[l] + buf[l + w];
  return buf[0];
}

static void scale_row(const float *x, long n, float inv, const float *w, int offset, float *out) {
  if (!w)
    for (long i = 0; i < n; i++) out[i] = x[i] * inv;
  else if (offset)
    for (long i = 0; i < n; i++) out[i] = (x[i] * inv) * (1.0f + w[i]);
  else
    for (long i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

int rowdot_rms_norm(const float *x, long R, long n, float inv_n, float eps, const float *w, long wrap,
                    int offset, float *out) {
  long blocks = (n + RMS_LANES - 1) / RMS_LANES + 1; /* room for one odd level's zero block */
  float stack_buf[RMS_STACK_BLOCKS * RMS_LANES];
  float *buf = blocks <= RMS_STACK_BLOCKS ? stack_buf : malloc(sizeof(float) * RMS_LANES * blocks);
  if (!buf) return -1;
  for (long r = 0; r < R; r++) {
    float v = tree_sum_squares(x + r * n, n, buf) * inv_n;
    v = v + eps;
    scale_row(x + r * n, n, 1.0f / sqrtf(v), w ? w + (r % wrap) * n : NULL, offset, out + r * n);
  }
  if (buf != stack_buf) free(buf);
  return 0;
}

/* Decode attention: one query token per request over that request's own keys, read in place
 * from the paged pool by slot (no gather). Each request's result is computed on its own, in a
 * fixed order, so it depends only on its query and its keys: not on the batch, nor on the
 * build (every step is one IEEE operation, the same on AVX-512, AVX2 and portable):
 *   - score s_c = dot(q, k_c) * scale, the dot as 16 partial sums (lane l: the products of
 *     d = l mod 16, in order of d, one fused multiply-add each), lane l += lane l + 8, then
 *     `pair8`;
 *   - m = the largest score; e_c = rowdot_exp(s_c - m) (below);
 *   - total = the e_c summed as 16 partial sums (lane l: keys c = l mod 16, in order), folded as
 *     the scores' lanes are;
 *   - out[d] = (sum over c in order of e_c * v_c[d], one fused multiply-add each) / total.
 * rowdot_exp(x), x <= 0: 0 below -87; else n = nearest integer of x * log2(e) (the 1.5 * 2^23
 * rounding trick), r = x - n ln2 (ln2 in two parts, fused), a degree-6 Taylor polynomial of
 * e^r by Horner (fused; its truncation error under 1.2e-7 relative on |r| <= ln2 / 2), times
 * 2^n.
 *
 * Shapes: q (R, Hq, D), k and v (S, Hkv, D) contiguous fp32, Hq a multiple of Hkv (query head
 * h reads kv head h / (Hq / Hkv)); request r's keys are at slots[starts[r] .. starts[r+1]);
 * scratch holds (Hq / Hkv) * (the longest request's key count) floats; out (R, Hq, D). */
#define DOT_LANES 16
#define DOT_VECS (DOT_LANES / LANES)

static inline float fold16(const float p[DOT_LANES]) {
  float h[8];
  for (int i = 0; i < 8; i++) h[i] = p[i] + p[i + 8];
  return pair8(h);
}

static float dot16(const float *restrict a, const float *restrict b, long D) { /* any D */
  float p[DOT_LANES] = {0};
  for (long d = 0; d < D; d++) p[d % DOT_LANES] = fmaf(a[d], b[d], p[d % DOT_LANES]);
  return fold16(p);
}

static inline float dot(const float *restrict a, const float *restrict b, long D) {
  if (D % DOT_LANES) return dot16(a, b, D);
  vec acc0 = VZERO();
#if DOT_VECS == 2
  vec acc1 = VZERO();
#endif
  for (long d = 0; d < D; d += DOT_LANES) {
    acc0 = PFMA(VLOAD(a + d), VLOAD(b + d), acc0);
#if DOT_VECS == 2
    acc1 = PFMA(VLOAD(a + d + LANES), VLOAD(b + d + LANES), acc1);
#endif
  }
#if DOT_VECS == 2
  acc0 = acc0 + acc1; /* lane l + lane l + 8, as fold16 */
#endif
  return vsum(acc0); /* the rest of fold16's order on every build */
}

static inline float rowdot_exp(float x) {
  const float shift = 12582912.0f; /* 1.5 * 2^23: adding and taking it away rounds to an integer */
  float n = (x * 1.44269504088896341f + shift) - shift;
  float r = fmaf(n, -0.693145751953125f, x);
  r = fmaf(n, -1.42860682030941723e-6f, r);
  float p = 1.0f / 720.0f;
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  int bits = ((int)n + 127) << 23;
  float two_n;
  __builtin_memcpy(&two_n, &bits, sizeof two_n);
  return x > -87.0f ? p * two_n : 0.0f;
}

static void exp_shifted(float *restrict e, long n, float m) {
  for (long c = 0; c < n; c++) e[c] = rowdot_exp(e[c] - m);
}

static float sum16(const float *restrict x, long n) {
  float p[DOT_LANES] = {0};
  long c = 0;
  for (; c + DOT_LANES <= n; c += DOT_LANES)
    for (int i = 0; i < DOT_LANES; i++) p[i] = p[i] + x[c + i];
  for (long t = 0; c + t < n; t++) p[t] = p[t] + x[c + t];
  return fold16(p);
}

/* The largest of x[0 .. n), n >= 1 (exact in any order: in 16 lanes, so it vectorizes). */
static float max16(const float *restrict x, long n) {
  float p[DOT_LANES];
  for (int i = 0; i < DOT_LANES; i++) p[i] = x[0];
  long c = 0;
  for (; c + DOT_LANES <= n; c += DOT_LANES)
    for (int i = 0; i < DOT_LANES; i++) p[i] = x[c + i] > p[i] ? x[c + i] : p[i];
  for (long t = 0; c + t < n; t++) p[t] = x[c + t] > p[t] ? x[c + t] : p[t];
  float m = p[0];
  for (int i = 1; i < DOT_LANES; i++) m = p[i] > m ? p[i] : m;
  return m;
}

/* acc[p] = sum over k in order of coef[k * cstride] * row_k[p] (fused, from 0), the accumulators
 * of 4 vectors of p in registers while the rows stream past; row k is rows + idx[k] * ld (idx: a
 * request's key slots in the pool), or rows + k * ld without idx. */
static void chain_rows_at(const float *restrict coef, long cstride, const float *restrict rows,
                          const long *restrict idx, long ld, long K, long P, float *restrict acc) {
#define ROW(k) (rows + (idx ? idx[k] : (k)) * ld)
  long p0 = 0;
  for (; p0 + 4 * LANES <= P; p0 += 4 * LANES) {
    vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    for (long k = 0; k < K; k++) {
      const float *r = ROW(k) + p0;
      vec w = VBCAST(coef + k * cstride);
      a0 = PFMA(w, VLOAD(r), a0);
      a1 = PFMA(w, VLOAD(r + LANES), a1);
      a2 = PFMA(w, VLOAD(r + 2 * LANES), a2);
      a3 = PFMA(w, VLOAD(r + 3 * LANES), a3);
    }
    VSTORE(acc + p0, a0);
    VSTORE(acc + p0 + LANES, a1);
    VSTORE(acc + p0 + 2 * LANES, a2);
    VSTORE(acc + p0 + 3 * LANES, a3);
  }
  for (; p0 + LANES <= P; p0 += LANES) {
    vec a = VZERO();
    for (long k = 0; k < K; k++) a = PFMA(VBCAST(coef + k * cstride), VLOAD(ROW(k) + p0), a);
    VSTORE(acc + p0, a);
  }
  for (; p0 < P; p0++) {
    float a = 0.0f;
    for (long k = 0; k < K; k++) a = fmaf(coef[k * cstride], ROW(k)[p0], a);
    acc[p0] = a;
  }
#undef ROW
}

static void chain_rows(const float *restrict coef, long cstride, const float *restrict rows, long ld,
                       long K, long P, float *restrict acc) {
  chain_rows_at(coef, cstride, rows, NULL, ld, K, P, acc);
}

static void attend_head(const float *restrict q, const float *restrict k, const float *restrict v,
                        const long *restrict slots, long L, long grp, long stride, long D, float scale,
                        float *restrict e, float *restrict out) {
  for (long c = 0; c < L; c++) { /* each key read once for the group's queries */
    const float *kc = k + slots[c] * stride;
    for (long g = 0; g < grp; g++) e[g * L + c] = dot(q + g * D, kc, D) * scale;
  }
  for (long g = 0; g < grp; g++) {
    float *eg = e + g * L, *o = out + g * D;
    exp_shifted(eg, L, max16(eg, L));
    float total = sum16(eg, L);
    chain_rows_at(eg, 1, v, slots, stride, L, D, o); /* out[d]: e_c * v_c[d], c in order */
    for (long d = 0; d < D; d++) o[d] = o[d] / total;
  }
}

void rowdot_decode_attention(const float *q, const float *k, const float *v, const long *slots,
                             const long *starts, long R, long Hq, long Hkv, long D, float scale,
                             float *scratch, float *out) {
  long grp = Hq / Hkv, stride = Hkv * D;
  for (long r = 0; r < R; r++) {
    long L = starts[r + 1] - starts[r];
    for (long h = 0; h < Hkv; h++) {
      float *o = out + (r * Hq + h * grp) * D;
      if (L == 0) {
        for (long i = 0; i < grp * D; i++) o[i] = 0.0f;
        continue;
      }
      attend_head(q + (r * Hq + h * grp) * D, k + h * D, v + h * D, slots + starts[r], L, grp, stride,
                  D, scale, scratch, o);
    }
  }
}

/* The chunked SSD scan of a prefill (`actors.mamba.ssd_chunked`'s algorithm) for one sequence,
 * head by head, chunk by chunk, with the head's state kept in cache between chunks. Per head h
 * and chunk (steps t0 .. t0 + n - 1, n <= l; E(u) = rowdot_exp(u), or 0 below -60), all fp32:
 *   a_i = dt_i * A;  s_i = s_{i-1} + a_i (s_0 = a_0);  u_j[p] = x_j[p] * dt_j;
 *   CB_ij = the `dot` of C_i and B_j (its group's; j <= i);
 *   y_i[p] = fma(off, E(s_i), diag), where off = the sum over nn in order of C_i[nn] * S[nn][p]
 *     and diag = the sum over j = 0 .. i in order of (CB_ij * E(s_i - s_j)) * u_j[p] (each sum
 *     a chain of fused multiply-adds from 0);
 *   then S[nn][p] = fma(S[nn][p], E(s_{n-1}), the sum over j in order of B_j[nn] * w_j[p]),
 *     w_j[p] = u_j[p] * E(s_{n-1} - s_j).
 * So a chunk's results depend only on its own inputs and the state entering it: a prefill cut
 * at a multiple of l continues to the bits of an uncached one, and every build gives the same
 * bits (lane-wise fused multiply-adds, the exp and `dot` as above).
 *
 * Shapes: x rows ldx apart, each (H, P); B and C rows ldbc apart, each (G, N); dt (L, H) and A
 * (H) contiguous; state (H, P, N) or NULL (zeros); final (H, P, N); starts (chunks, H, N, P) or
 * NULL: the state entering each chunk; y (L, H, P). Heads [h0, h1) (threads take head ranges).
 * cb (chunks, G, l, l): every chunk's CB, made by a call with `make_cb` 1 and read by calls
 * with 0; work ((h1 - h0) * N * P + l * (2 * P + 3) + 4 * P floats) is a call's own. */
#define SSD_FLOOR -60.0f
static inline float decay_e(float u) { return u > SSD_FLOOR ? rowdot_exp(u) : 0.0f; }

/* chain_rows for two coefficient sets at once (outputs acc and acc2), sharing each row's loads:
 * the same chains, so the same bits. */
static void chain_rows2(const float *restrict coef, const float *restrict coef2, long cstride,
                        const float *restrict rows, long ld, long K, long P, float *restrict acc,
                        float *restrict acc2) {
  long p0 = 0;
  for (; p0 + 4 * LANES <= P; p0 += 4 * LANES) {
    vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    vec b0 = VZERO(), b1 = VZERO(), b2 = VZERO(), b3 = VZERO();
    for (long k = 0; k < K; k++) {
      const float *r = rows + k * ld + p0;
      vec w = VBCAST(coef + k * cstride), w2 = VBCAST(coef2 + k * cstride);
      vec r0 = VLOAD(r), r1 = VLOAD(r + LANES), r2 = VLOAD(r + 2 * LANES), r3 = VLOAD(r + 3 * LANES);
      a0 = PFMA(w, r0, a0);
      a1 = PFMA(w, r1, a1);
      a2 = PFMA(w, r2, a2);
      a3 = PFMA(w, r3, a3);
      b0 = PFMA(w2, r0, b0);
      b1 = PFMA(w2, r1, b1);
      b2 = PFMA(w2, r2, b2);
      b3 = PFMA(w2, r3, b3);
    }
    VSTORE(acc + p0, a0);
    VSTORE(acc + p0 + LANES, a1);
    VSTORE(acc + p0 + 2 * LANES, a2);
    VSTORE(acc + p0 + 3 * LANES, a3);
    VSTORE(acc2 + p0, b0);
    VSTORE(acc2 + p0 + LANES, b1);
    VSTORE(acc2 + p0 + 2 * LANES, b2);
    VSTORE(acc2 + p0 + 3 * LANES, b3);
  }
  if (p0 < P) {
    chain_rows(coef, cstride, rows + p0, ld, K, P - p0, acc + p0);
    chain_rows(coef2, cstride, rows + p0, ld, K, P - p0, acc2 + p0);
  }
}

#if LANES == 16
/* chain_rows for four coefficient sets at once (c[0..3] -> o[0..3]), sharing each row's loads
 * (the 16 accumulators fit AVX-512's registers): the same chains, so the same bits. */
static void chain_rows4(const float *const c[4], long cstride, const float *restrict rows, long ld, long K,
                        long P, float *const o[4]) {
  long p0 = 0;
  for (; p0 + 4 * LANES <= P; p0 += 4 * LANES) {
    vec a[4][4];
    for (int q = 0; q < 4; q++)
      for (int i = 0; i < 4; i++) a[q][i] = VZERO();
    for (long k = 0; k < K; k++) {
      const float *r = rows + k * ld + p0;
      vec r0 = VLOAD(r), r1 = VLOAD(r + LANES), r2 = VLOAD(r + 2 * LANES), r3 = VLOAD(r + 3 * LANES);
      for (int q = 0; q < 4; q++) {
        vec w = VBCAST(c[q] + k * cstride);
        a[q][0] = PFMA(w, r0, a[q][0]);
        a[q][1] = PFMA(w, r1, a[q][1]);
        a[q][2] = PFMA(w, r2, a[q][2]);
        a[q][3] = PFMA(w, r3, a[q][3]);
      }
    }
    for (int q = 0; q < 4; q++)
      for (int i = 0; i < 4; i++) VSTORE(o[q] + p0 + i * LANES, a[q][i]);
  }
  if (p0 < P)
    for (int q = 0; q < 4; q++) chain_rows(c[q], cstride, rows + p0, ld, K, P - p0, o[q] + p0);
}
#endif

static void ssd_chunk(const float *restrict x, long ldx, const float *restrict dt, long H, float A,
                      const float *restrict B, const float *restrict C, long ldbc, const float *restrict cb,
                      long n, long l, long P, long N, float *restrict S, float *restrict y,
                      float *restrict work) {
  float *s = work, *u = s + l, *w = u + l * P, *coef = w + l * P, *off = coef + 2 * l, *diag = off + 2 * P;
  for (long i = 0; i < n; i++) {
    float a = dt[i * H] * A;
    s[i] = i ? s[i - 1] + a : a;
    for (long p = 0; p < P; p++) u[i * P + p] = x[i * ldx + p] * dt[i * H];
  }
  for (long i = 0; i < n; i += 2) {
    int two = i + 1 < n;
    float *c1 = coef + l;
    if (two)
      chain_rows2(C + i * ldbc, C + (i + 1) * ldbc, 1, S, P, N, P, off, off + P);
    else
      chain_rows(C + i * ldbc, 1, S, P, N, P, off);
    for (long j = 0; j <= i; j++) coef[j] = cb[i * l + j] * decay_e(s[i] - s[j]);
    if (two) {
      for (long j = 0; j <= i + 1; j++) c1[j] = cb[(i + 1) * l + j] * decay_e(s[i + 1] - s[j]);
      chain_rows2(coef, c1, 1, u, P, i + 1, P, diag, diag + P);
      for (long p = 0; p < P; p++) diag[P + p] = fmaf(c1[i + 1], u[(i + 1) * P + p], diag[P + p]);
    } else {
      chain_rows(coef, 1, u, P, i + 1, P, diag);
    }
    for (long r = 0; r <= two; r++) {
      float e = decay_e(s[i + r]);
      for (long p = 0; p < P; p++) y[(i + r) * H * P + p] = fmaf(off[r * P + p], e, diag[r * P + p]);
    }
  }
  float end = decay_e(s[n - 1]);
  for (long j = 0; j < n; j++) {
    float d = decay_e(s[n - 1] - s[j]);
    for (long p = 0; p < P; p++) w[j * P + p] = u[j * P + p] * d;
  }
  long nn = 0;
  for (; nn + 1 < N; nn += 2) {
    chain_rows2(B + nn, B + nn + 1, ldbc, w, P, n, P, off, off + P);
    for (long p = 0; p < 2 * P; p++) S[nn * P + p] = fmaf(S[nn * P + p], end, off[p]);
  }
  for (; nn < N; nn++) {
    chain_rows(B + nn, ldbc, w, P, n, P, off);
    for (long p = 0; p < P; p++) S[nn * P + p] = fmaf(S[nn * P + p], end, off[p]);
  }
}

void rowdot_ssd_scan(const float *x, long ldx, const float *dt, const float *A, const float *B,
                     const float *C, long ldbc, long L, long H, long P, long G, long N, long l,
                     const float *state, float *final, float *starts, float *y, long h0, long h1,
                     float *cb, int make_cb, float *work) {
  long chunks = (L + l - 1) / l, K = H / G;
  if (make_cb)
    for (long c = 0; c < chunks; c++)
      for (long g = 0; g < G; g++) {
        long t0 = c * l, n = L - t0 < l ? L - t0 : l;
        float *m = cb + (c * G + g) * l * l;
        for (long i = 0; i < n; i++)
          for (long j = 0; j <= i; j++) m[i * l + j] = dot(C + (t0 + i) * ldbc + g * N, B + (t0 + j) * ldbc + g * N, N);
      }
  /* chunk by chunk, every head of the range in turn: a chunk's rows of x, B, C and y stay in
   * cache across its heads, and the heads' states (work) in L2 across chunks */
  long nh = h1 - h0;
  float *states = work, *scratch = work + nh * N * P;
  for (long h = h0; h < h1; h++) {
    float *S = states + (h - h0) * N * P;
    for (long p = 0; p < P; p++)
      for (long nn = 0; nn < N; nn++) S[nn * P + p] = state ? state[(h * P + p) * N + nn] : 0.0f;
  }
  for (long c = 0; c < chunks; c++) {
    long t0 = c * l, n = L - t0 < l ? L - t0 : l;
    for (long h = h0; h < h1; h++) {
      long g = h / K;
      float *S = states + (h - h0) * N * P;
      if (starts) __builtin_memcpy(starts + (c * H + h) * N * P, S, sizeof(float) * N * P);
      ssd_chunk(x + t0 * ldx + h * P, ldx, dt + t0 * H + h, H, A[h], B + t0 * ldbc + g * N,
                C + t0 * ldbc + g * N, ldbc, cb + (c * G + g) * l * l, n, l, P, N, S,
                y + (t0 * H + h) * P, scratch);
    }
  }
  for (long h = h0; h < h1; h++) {
    const float *S = states + (h - h0) * N * P;
    for (long p = 0; p < P; p++)
      for (long nn = 0; nn < N; nn++) final[(h * P + p) * N + nn] = S[nn * P + p];
  }
}

/* Prefill attention, causal, for the new rows of one sequence: query row t (at position
 * first + t) attends over keys 0 .. first + t. Each row is computed on its own, so its bits
 * depend only on its query and its keys: not on where the call starts or ends (a prefill resumed
 * at any point gives an uncached run's bits), nor on the build. Per row and query head, fp32:
 *   s_j = (the sum over d in order of q[d] * k_j[d], a fused multiply-add chain from 0) * scale;
 *   m = the largest s_j; e_j = rowdot_exp(s_j - m); total = sum16(e);
 *   out[p] = (the sum over j in order of e_j * v_j[p], fused, from 0) / total.
 * (The scores' chains run over d with the keys in lanes: the keys are transposed once per kv
 * head into work.) Shapes: q (L, Hq, D), k and v (first + L, Hkv, D) contiguous fp32; out
 * (L, Hq, D); work holds (D + 4) * W floats, W = first + L rounded up to a multiple of 64.
 * Query rows [t0, t1). */
/* Scores, softmax and output of `nq` (1, 2 or 4) query heads of one row sharing their keys. */
static void attend_queries(const float *q, long nq, const float *kt, long W, long n, long D, float scale,
                           const float *v, long ld, float *e, float *o) {
  long nw = (n + 4 * DOT_LANES - 1) / (4 * DOT_LANES) * (4 * DOT_LANES); /* whole blocks of keys */
  const float *c[4] = {q, q + D, q + 2 * D, q + 3 * D};
  float *es[4] = {e, e + W, e + 2 * W, e + 3 * W}, *os[4] = {o, o + D, o + 2 * D, o + 3 * D};
#if LANES == 16
  if (nq == 4) chain_rows4(c, 1, kt, W, D, nw, es); else
#endif
  if (nq >= 2) {
    chain_rows2(c[0], c[1], 1, kt, W, D, nw, es[0], es[1]);
    if (nq == 4) chain_rows2(c[2], c[3], 1, kt, W, D, nw, es[2], es[3]);
  } else {
    chain_rows(c[0], 1, kt, W, D, nw, es[0]);
  }
  float total[4];
  for (long r = 0; r < nq; r++) {
    for (long j = 0; j < n; j++) es[r][j] = es[r][j] * scale;
    exp_shifted(es[r], n, max16(es[r], n));
    total[r] = sum16(es[r], n);
  }
#if LANES == 16
  if (nq == 4) chain_rows4((const float *const *)es, 1, v, ld, n, D, os); else
#endif
  if (nq >= 2) {
    chain_rows2(es[0], es[1], 1, v, ld, n, D, os[0], os[1]);
    if (nq == 4) chain_rows2(es[2], es[3], 1, v, ld, n, D, os[2], os[3]);
  } else {
    chain_rows(es[0], 1, v, ld, n, D, os[0]);
  }
  for (long r = 0; r < nq; r++)
    for (long p = 0; p < D; p++) os[r][p] = os[r][p] / total[r];
}

void rowdot_prefill_attention(const float *q, const float *k, const float *v, long L, long first, long Hq,
                              long Hkv, long D, float scale, float *out, long t0, long t1, float *work) {
  long S = first + L, grp = Hq / Hkv, ld = Hkv * D;
  long W = (S + 4 * DOT_LANES - 1) / (4 * DOT_LANES) * (4 * DOT_LANES); /* keys padded to whole blocks */
  float *kt = work, *e = work + D * W;
  for (long h = 0; h < Hkv; h++) {
    for (long d = 0; d < D; d++) {
      for (long j = 0; j < S; j++) kt[d * W + j] = k[j * ld + h * D + d];
      for (long j = S; j < W; j++) kt[d * W + j] = 0.0f;
    }
    for (long t = t0; t < t1; t++)
      for (long g = 0; g < grp;) {
        long nq = grp - g >= 4 ? 4 : grp - g >= 2 ? 2 : 1;
        long at = (t * Hq + h * grp + g) * D;
        attend_queries(q + at, nq, kt, W, first + t + 1, D, scale, v + h * D, ld, e, out + at);
        g += nq;
      }
  }
}
