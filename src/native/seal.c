#include "seal.h"

#ifdef BL_OPENSSL
/* GCM's block cipher: AES-256 of one block under the job's key (``key`` is the sealer).
 * A failure is remembered, and every tag from then on fails. */
static void aes_block(const unsigned char in[16], unsigned char out[16], const void *key) {
    Sealer *s = (Sealer *)key;
    int len = 0;
    if (EVP_EncryptUpdate(s->aes, out, &len, in, 16) != 1 || len != 16) {
        memset(out, 0, 16);
        s->crypto_failed = 1;
    }
}
#endif

int sealer_start(Sealer *s, const unsigned char *key, uint32_t ip, uint16_t port,
                 const unsigned char *seed) {
#ifdef BL_OPENSSL
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (ctx == NULL || EVP_EncryptInit_ex(ctx, EVP_aes_256_ecb(), NULL, key, NULL) != 1
        || EVP_CIPHER_CTX_set_padding(ctx, 0) != 1) {
        EVP_CIPHER_CTX_free(ctx);
        return -1;
    }
    s->aes = ctx;
    s->crypto_failed = 0;
    s->gcm = CRYPTO_gcm128_new(s, aes_block);  /* (computes GHASH's key: one block) */
    if (s->gcm == NULL || s->crypto_failed) {
        if (s->gcm) CRYPTO_gcm128_release(s->gcm);
        s->gcm = NULL;
        EVP_CIPHER_CTX_free(ctx);
        s->aes = NULL;
        return -1;
    }
    put_ident(s->ident, ip, port);
    memcpy(s->prefix, seed, 4);
    s->counter = 0;
    for (int i = 0; i < 8; i++) s->counter = s->counter << 8 | seed[4 + i];
    s->counter >>= 2;  /* (as NonceSequence: it never wraps) */
    s->on = 1;
    return 0;
#else
    (void)s; (void)key; (void)ip; (void)port; (void)seed;
    return -1;
#endif
}

void sealer_release(Sealer *s) {
#ifdef BL_OPENSSL
    if (s->gcm) CRYPTO_gcm128_release(s->gcm);
    EVP_CIPHER_CTX_free(s->aes);
    s->gcm = NULL;
    s->aes = NULL;
#endif
    s->on = 0;
}

int sealer_tag(Sealer *s, const unsigned char *src, const unsigned char *dst,
               const unsigned char *a, size_t an, const unsigned char *b, size_t bn,
               const unsigned char *nonce, unsigned char *tag) {
#ifdef BL_OPENSSL
    unsigned char head[2 * IDENT_BYTES + HEADER_BYTES];
    GCM128_CONTEXT *g = s->gcm;
    if (g == NULL) return -1;
    /* the addresses and the header in one piece: one call, not three */
    size_t m = an < HEADER_BYTES ? an : HEADER_BYTES;
    memcpy(head, src, IDENT_BYTES);
    memcpy(head + IDENT_BYTES, dst, IDENT_BYTES);
    memcpy(head + 2 * IDENT_BYTES, a, m);
    /* GCM with associated data only: the key stays, the nonce is this datagram's */
    CRYPTO_gcm128_setiv(g, nonce, NONCE_BYTES);
    if (CRYPTO_gcm128_aad(g, head, 2 * IDENT_BYTES + m) != 0
        || (an > m && CRYPTO_gcm128_aad(g, a + m, an - m) != 0)
        || (bn && CRYPTO_gcm128_aad(g, b, bn) != 0))
        return -1;
    CRYPTO_gcm128_tag(g, tag, TAG_BYTES);
    return s->crypto_failed ? -1 : 0;
#else
    (void)s; (void)src; (void)dst; (void)a; (void)an; (void)b; (void)bn; (void)nonce;
    (void)tag;
    return -1;
#endif
}

int gmac_tag(Sealer *s, const unsigned char *aad, size_t n, const unsigned char *nonce,
             unsigned char *tag) {
#ifdef BL_OPENSSL
    GCM128_CONTEXT *g = s->gcm;
    if (g == NULL) return -1;
    CRYPTO_gcm128_setiv(g, nonce, NONCE_BYTES);
    if (n && CRYPTO_gcm128_aad(g, aad, n) != 0) return -1;
    CRYPTO_gcm128_tag(g, tag, TAG_BYTES);
    return s->crypto_failed ? -1 : 0;
#else
    (void)s; (void)aad; (void)n; (void)nonce; (void)tag;
    return -1;
#endif
}

/* This sealer's next nonce into ``out`` (never one it gave before: see auth.py). */
static inline void next_nonce(Sealer *s, unsigned char *out) {
    uint64_t n = s->counter++;
    memcpy(out, s->prefix, 4);
    for (int i = 0; i < 8; i++) out[4 + i] = (unsigned char)(n >> (56 - 8 * i));
}

int sealer_seal(Sealer *s, const unsigned char *dst, const unsigned char *a, size_t an,
                const unsigned char *b, size_t bn, unsigned char *trailer) {
    next_nonce(s, trailer);
    return sealer_tag(s, s->ident, dst, a, an, b, bn, trailer, trailer + NONCE_BYTES);
}

int sealer_tags_equal(const unsigned char *x, const unsigned char *y) {
#ifdef BL_OPENSSL
    return CRYPTO_memcmp(x, y, TAG_BYTES) == 0;  /* constant time */
#else
    (void)x; (void)y;
    return 0;
#endif
}
