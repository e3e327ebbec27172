/* Sealer: a job's AES-256-GMAC tags and this endpoint's nonces, as protocol/auth.py makes
 * them - the tag under a nonce over source address, destination address, header and
 * payload, through OpenSSL. No Python object: its functions hold or release no GIL and
 * set no Python error (they return -1 where OpenSSL failed). */
#ifndef BL_SEAL_H
#define BL_SEAL_H

#include "native.h"

typedef struct {
    int on;                            /* started: every datagram carries a tag */
    unsigned char ident[IDENT_BYTES];  /* our own address as a tag covers it */
    unsigned char prefix[4];           /* this sealer's nonces: prefix, then a counter */
    uint64_t counter;
#ifdef BL_OPENSSL
    /* GCM under the job's key, driven through OpenSSL's own GCM (the code its EVP
     * AES-GCM runs) rather than the EVP layer: a datagram's fixed cost 0.07 us instead
     * of 0.17 (BENCHMARKS.md, "Authenticated datagrams"). Its block cipher is AES-256
     * through EVP (AES-NI where the CPU has it). */
    GCM128_CONTEXT *gcm;
    EVP_CIPHER_CTX *aes;
    int crypto_failed;                 /* the block cipher failed once: tag nothing more */
#endif
} Sealer;

/* An address as a tag's input covers it: 4, the IPv4 address, the port. */
static inline void put_ident(unsigned char *o, uint32_t ip, uint16_t port) {
    o[0] = 4;
    o[1] = (unsigned char)(ip >> 24); o[2] = (unsigned char)(ip >> 16);
    o[3] = (unsigned char)(ip >> 8); o[4] = (unsigned char)ip;
    o[5] = (unsigned char)(port >> 8); o[6] = (unsigned char)port;
}

/* Start under ``key`` (KEY_BYTES) as the endpoint (ip, port), its nonces from ``seed``
 * (NONCE_BYTES). 0; -1 where OpenSSL has no AES-256 or its GCM could not start (the
 * sealer stays off). */
int sealer_start(Sealer *s, const unsigned char *key, uint32_t ip, uint16_t port,
                 const unsigned char *seed);
void sealer_release(Sealer *s);
/* The tag under ``nonce`` of a datagram from ``src`` to ``dst`` whose bytes are a[0:an]
 * then b[0:bn] (header and payload may lie apart). 0, or -1 if OpenSSL failed. */
int sealer_tag(Sealer *s, const unsigned char *src, const unsigned char *dst,
               const unsigned char *a, size_t an, const unsigned char *b, size_t bn,
               const unsigned char *nonce, unsigned char *tag);
/* The tag under ``nonce`` of the bytes aad[0:n] as they are (no addresses put before
 * them): protocol/auth.py's Gmac.tag. 0, or -1 if OpenSSL failed. */
int gmac_tag(Sealer *s, const unsigned char *aad, size_t n, const unsigned char *nonce,
             unsigned char *tag);
/* Seal the datagram a[0:an] b[0:bn] from us to ``dst``: its trailer (this sealer's next
 * nonce, the tag) into ``trailer``. */
int sealer_seal(Sealer *s, const unsigned char *dst, const unsigned char *a, size_t an,
                const unsigned char *b, size_t bn, unsigned char *trailer);
/* Whether two tags are equal, in constant time. */
int sealer_tags_equal(const unsigned char *x, const unsigned char *y);

#endif
