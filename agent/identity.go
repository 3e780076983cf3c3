package agent

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The files of an identity directory, named like the keys of a
// kubernetes.io/tls Secret so that the directory can be a mounted Secret
// and the Secret identity store uses the same keys.
const (
	CertFile   = "tls.crt"
	KeyFile    = "tls.key"
	BundleFile = "ca.crt"
)

// identity is the agent's client certificate (with its chain), its private
// key and the trust bundle, held in memory. Both identity stores load into
// it and every broker client presents it, so that files and a Secret take
// one code path.
type identity struct {
	// spiffeID is the cluster identity in the certificate's URI SAN.
	spiffeID  string
	cert      *tls.Certificate // Leaf is set
	certPEM   []byte
	keyPEM    []byte // a secret: never log it
	bundlePEM []byte
	roots     *x509.CertPool
}

func (id *identity) leaf() *x509.Certificate { return id.cert.Leaf }

// parseIdentity checks that the key matches the certificate, that the
// certificate names a cluster identity and that the bundle holds
// certificates. Expiry is the caller's business.
func parseIdentity(certPEM, keyPEM, bundlePEM []byte) (*identity, error) {
	certs, err := pki.ParseCertificatesPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate: %w", err)
	}
	if _, err := pki.ParsePrivateKeyPEM(keyPEM); err != nil {
		return nil, fmt.Errorf("key: %w", err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("certificate and key: %w", err)
	}
	pair.Leaf = certs[0]
	spiffeID, err := pki.IdentityFromCert(certs[0])
	if err != nil {
		return nil, fmt.Errorf("certificate: %w", err)
	}
	roots, err := certPool(bundlePEM)
	if err != nil {
		return nil, err
	}
	return &identity{
		spiffeID:  spiffeID,
		cert:      &pair,
		certPEM:   certPEM,
		keyPEM:    keyPEM,
		bundlePEM: bundlePEM,
		roots:     roots,
	}, nil
}

// identityHolder is the identity in service. Readers never block; a
// renewal swaps the whole identity at once.
type identityHolder struct {
	p atomic.Pointer[identity]
}

func (h *identityHolder) get() *identity   { return h.p.Load() }
func (h *identityHolder) set(id *identity) { h.p.Store(id) }
func (h *identityHolder) loaded() bool     { return h.p.Load() != nil }
func (h *identityHolder) leaf() *x509.Certificate {
	if id := h.p.Load(); id != nil {
		return id.leaf()
	}
	return nil
}

// GetClientCertificate is the tls.Config hook of every broker client: the
// certificate in service at the moment of the handshake. Before an identity
// is loaded it presents none, which the broker refuses.
func (h *identityHolder) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	if id := h.p.Load(); id != nil {
		return id.cert, nil
	}
	return &tls.Certificate{}, nil
}

// EnrollOptions configure Enroll.
type EnrollOptions struct {
	// BrokerURL is the broker's enrollment listener, e.g. https://east.example.com:8444.
	BrokerURL string
	// Fingerprint pins the CA ("sha256:<hex>"): the trust bundle is
	// fetched and verified against it when Bundle is empty, and the
	// caBundle of the broker's answer must hold it.
	Fingerprint string
	// Bundle is a trust bundle the caller already trusts; if empty it is
	// fetched from the broker and checked against Fingerprint.
	Bundle []byte
	// Token is the join token.
	Token string
	// Dir receives tls.crt, tls.key (0600) and ca.crt.
	Dir IdentityDir
}

// Enroll makes a key pair, sends a CSR for the join token's identity with
// the token, and writes the certificate, the key and the trust bundle to
// opts.Dir (see IdentityDir for how the three files are replaced
// together). The trust bundle written is the one the broker was verified
// with (opts.Bundle, or the pinned CA and the fetched CAs that chain to
// it), never the caBundle of the broker's answer, which must hold the
// pinned CA when opts.Fingerprint is set.
// The private key never leaves this process except into opts.Dir. Nothing
// is written if enrollment fails.
func Enroll(ctx context.Context, opts EnrollOptions) (*apiv1.CertificateResponse, error) {
	id, resp, err := enroll(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := (dirStore{dir: opts.Dir}).save(ctx, id); err != nil {
		return nil, err
	}
	return resp, nil
}

// enroll obtains a first identity with a join token; opts.Dir is unused.
func enroll(ctx context.Context, opts EnrollOptions) (*identity, *apiv1.CertificateResponse, error) {
	claims, err := parseJoinToken(opts.Token)
	if err != nil {
		return nil, nil, err
	}
	bundle := opts.Bundle
	if len(bundle) == 0 {
		if bundle, err = client.FetchTrustBundle(ctx, opts.BrokerURL, opts.Fingerprint); err != nil {
			return nil, nil, fmt.Errorf("fetch trust bundle: %w", err)
		}
	}
	roots, err := certPool(bundle)
	if err != nil {
		return nil, nil, err
	}
	c, err := client.New(client.Config{URL: opts.BrokerURL, RootCAs: roots})
	if err != nil {
		return nil, nil, err
	}
	defer c.CloseIdleConnections()
	csrPEM, keyPEM, err := pki.NewCSR(claims.sub, rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("make CSR: %w", err)
	}
	resp, err := c.Enroll(ctx, opts.Token, csrPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("enroll: %w", err)
	}
	if opts.Fingerprint != "" {
		// The broker was verified against the pinned CA; a bundle in its
		// answer that lacks that CA is not from the operators' broker.
		if err := pki.VerifyBundleFingerprint([]byte(resp.CABundle), opts.Fingerprint); err != nil {
			return nil, nil, fmt.Errorf("enroll: the broker's caBundle: %w", err)
		}
	}
	// Keep the bundle that was verified, never the answer's: the answer
	// could add an anchor beside the pinned CA.
	id, err := parseIdentity([]byte(resp.Certificate), keyPEM, bundle)
	if err != nil {
		return nil, nil, fmt.Errorf("issued certificate: %w", err)
	}
	return id, resp, nil
}

// renewAPI is the part of the broker API that renewal needs;
// *client.Client implements it.
type renewAPI interface {
	Renew(ctx context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error)
}

// Renew asks the broker, through c (which authenticates with the current
// certificate in dir), for a new certificate with a new key for the same
// identity, and replaces the files in dir. The old files stay if anything
// fails.
func Renew(ctx context.Context, c *client.Client, dir IdentityDir) (*apiv1.CertificateResponse, error) {
	store := dirStore{dir: dir}
	cur, err := store.load(ctx)
	if err != nil {
		return nil, fmt.Errorf("read current identity: %w", err)
	}
	next, resp, err := renewIdentity(ctx, c, cur, cur.bundlePEM, time.Now())
	if err != nil {
		return nil, err
	}
	if err := store.save(ctx, next); err != nil {
		return nil, err
	}
	// New connections must present the new certificate.
	c.CloseIdleConnections()
	return resp, nil
}

// renewIdentity obtains a successor of cur: a new key, a CSR for the same
// identity, and a certificate that must name that identity and be valid at
// now. Its trust bundle is the part of the answer's caBundle that the CAs
// of trusted (PEM; cur's bundle, and the stored one if an operator wrote a
// new ca.crt since it was loaded) vouch for (pki.TrustedBundle); an answer
// with none of it is refused. It stores nothing.
func renewIdentity(ctx context.Context, api renewAPI, cur *identity, trusted []byte, now time.Time) (*identity, *apiv1.CertificateResponse, error) {
	csrPEM, keyPEM, err := pki.NewCSR(cur.spiffeID, rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("make CSR: %w", err)
	}
	resp, err := api.Renew(ctx, csrPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("renew: %w", err)
	}
	// Keep of the answer's caBundle only the CAs that the bundle in
	// service vouches for: the broker hands out its whole client-CA
	// bundle, partner CAs included, and any of them taken as an anchor
	// could issue a server certificate for the broker's name. A new,
	// unrelated root reaches the agent out of band (docs/pki.md,
	// "Rotating the CA").
	anchors, err := pki.ParseCertificatesPEM(trusted)
	if err != nil {
		return nil, nil, fmt.Errorf("renew: current trust bundle: %w", err)
	}
	bundlePEM, err := pki.TrustedBundle([]byte(resp.CABundle), anchors, now)
	if err != nil {
		return nil, nil, fmt.Errorf("renew: the broker's caBundle: %w", err)
	}
	next, err := parseIdentity([]byte(resp.Certificate), keyPEM, bundlePEM)
	if err != nil {
		return nil, nil, fmt.Errorf("issued certificate: %w", err)
	}
	if next.spiffeID != cur.spiffeID {
		return nil, nil, fmt.Errorf("renew: the broker issued a certificate for %s, not %s", next.spiffeID, cur.spiffeID)
	}
	if !now.Before(next.leaf().NotAfter) {
		return nil, nil, fmt.Errorf("renew: the issued certificate expired at %s", next.leaf().NotAfter.UTC().Format(time.RFC3339))
	}
	return next, resp, nil
}

func certPool(bundle []byte) (*x509.CertPool, error) {
	certs, err := pki.ParseCertificatesPEM(bundle)
	if err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}

// joinTokenClaims are what the client reads from a join token.
type joinTokenClaims struct {
	sub string
	jti string
}

// parseJoinToken reads the sub and jti claims of a join token without
// verifying it: the broker verifies the token; the client only needs to
// know which identity to put in its CSR, and the jti to log instead of the
// token.
func parseJoinToken(token string) (joinTokenClaims, error) {
	token = strings.TrimSpace(token)
	if strings.Count(token, ".") != 2 || len(token) > pki.MaxJoinTokenBytes {
		return joinTokenClaims{}, errors.New("the join token is not a JWT")
	}
	claims, err := pki.UnverifiedClaims(token)
	switch {
	case errors.Is(err, jwt.ErrTokenMalformed):
		return joinTokenClaims{}, errors.New("the join token is not a JWT")
	case err != nil || claims.Subject == "":
		return joinTokenClaims{}, errors.New("the join token names no identity (sub)")
	}
	if _, _, err := pki.ParseIdentity(claims.Subject); err != nil {
		return joinTokenClaims{}, fmt.Errorf("the join token's subject: %w", err)
	}
	return joinTokenClaims{sub: claims.Subject, jti: claims.ID}, nil
}
