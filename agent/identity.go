package agent

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"slices"
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
	// ClusterCACertFile and ClusterCAKeyFile hold the cluster's CA, if the
	// identity has one: its chain (the cluster CA, then any intermediates)
	// and its key (0600).
	ClusterCACertFile = "cluster-ca.crt"
	ClusterCAKeyFile  = "cluster-ca.key"
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
	// clusterCA is the cluster's CA, which signs its pod certificates;
	// nil when the identity has none.
	clusterCA *clusterCA
}

func (id *identity) leaf() *x509.Certificate { return id.cert.Leaf }

// clusterCA is the CA the broker signed for the identity's cluster
// (fleet CA → cluster CA → pod certificates), with its key.
type clusterCA struct {
	certPEM []byte
	keyPEM  []byte // a secret: never log it
	ca      *pki.CA
}

// withClusterCA returns a copy of id that holds the cluster CA of certPEM
// (the cluster CA, then any intermediates) and keyPEM, after checking that
// the key is the CA's, that the CA is a cluster CA of id's own identity
// (pki.ClusterCAIdentity), and that it chains to id's trust bundle at at.
// A zero at is the moment the CA was issued, so that a stored identity
// loads whatever the time, like its certificate: expiry is the caller's
// business.
func (id *identity) withClusterCA(certPEM, keyPEM []byte, at time.Time) (*identity, error) {
	ca, err := pki.ParseCA(certPEM, keyPEM, pki.CAOptions{})
	if err != nil {
		return nil, fmt.Errorf("cluster CA: %w", err)
	}
	cert := ca.Certificate()
	cluster, err := pki.ClusterCAIdentity(cert)
	if err != nil {
		return nil, fmt.Errorf("cluster CA: %w", err)
	}
	if cluster != id.spiffeID {
		return nil, fmt.Errorf("cluster CA: it is the CA of %s, not of %s", cluster, id.spiffeID)
	}
	if at.IsZero() {
		// NotBefore is backdated by pki.Backdate against clock skew.
		if at = cert.NotBefore.Add(pki.Backdate); !at.Before(cert.NotAfter) {
			at = cert.NotBefore
		}
	}
	inter := x509.NewCertPool()
	for _, c := range ca.Chain() {
		if !c.Equal(cert) {
			inter.AddCert(c)
		}
	}
	if _, err := cert.Verify(x509.VerifyOptions{
		Roots: id.roots, Intermediates: inter, CurrentTime: at,
		// A cluster CA's extended key usage is client authentication.
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	}); err != nil {
		return nil, fmt.Errorf("cluster CA: it does not chain to the trust bundle: %w", err)
	}
	next := *id
	next.clusterCA = &clusterCA{certPEM: certPEM, keyPEM: keyPEM, ca: ca}
	return &next, nil
}

// parseIdentity checks that the key matches the certificate, that the
// certificate names a cluster identity and that the bundle holds
// certificates. Expiry is the caller's business.
func parseIdentity(certPEM, keyPEM, bundlePEM []byte) (*identity, error) {
	return parseIdentityAs(certPEM, keyPEM, bundlePEM, false)
}

// parseIdentityAs is parseIdentity that, with workload, also takes a pod
// certificate (a workload identity, pki.IsWorkloadCertificate), as a
// workload's client presents it: never the agent's own identity, which
// speaks for its cluster.
func parseIdentityAs(certPEM, keyPEM, bundlePEM []byte, workload bool) (*identity, error) {
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
	if err != nil && workload && pki.IsWorkloadCertificate(certs[0]) {
		spiffeID, err = certs[0].URIs[0].String(), nil
	}
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

// clusterCA is the cluster CA of the identity in service, nil when there
// is none: the pod signer's CA source (podsigner.Config.CA), asked at
// every request so that a renewal's new CA signs from then on.
func (h *identityHolder) clusterCA() *pki.CA {
	if id := h.p.Load(); id != nil && id.clusterCA != nil {
		return id.clusterCA.ca
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
	// Dir receives tls.crt, tls.key (0600) and ca.crt, and with ClusterCA
	// cluster-ca.crt and cluster-ca.key (0600).
	Dir IdentityDir
	// ClusterCA asks the broker also for the cluster's CA, with a key of
	// its own (the agent as its cluster's pod-certificate signer). The
	// broker must run with --sign-cluster-cas, else enrollment fails.
	ClusterCA bool
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
	req, keys, err := newCertificateRequest(claims.sub, opts.ClusterCA)
	if err != nil {
		return nil, nil, err
	}
	resp, err := c.Enroll(ctx, opts.Token, req)
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
	id, err := parseIdentity([]byte(resp.Certificate), keys.key, bundle)
	if err != nil {
		return nil, nil, fmt.Errorf("issued certificate: %w", err)
	}
	if opts.ClusterCA {
		if id, err = takeClusterCA(id, resp, keys.clusterCAKey, time.Now()); err != nil {
			return nil, nil, fmt.Errorf("enroll: %w", err)
		}
	}
	return id, resp, nil
}

// requestKeys are the private keys of a CertificateRequest's CSRs; secrets.
type requestKeys struct {
	key          []byte
	clusterCAKey []byte // only when the cluster CA is asked for
}

// newCertificateRequest makes a key and a CSR for spiffeID and, with
// clusterCA, another key and CSR for the cluster's CA: two keys, so that
// the CA's key signs nothing but pod certificates.
func newCertificateRequest(spiffeID string, clusterCA bool) (apiv1.CertificateRequest, requestKeys, error) {
	csrPEM, keyPEM, err := pki.NewCSR(spiffeID, rand.Reader)
	if err != nil {
		return apiv1.CertificateRequest{}, requestKeys{}, fmt.Errorf("make CSR: %w", err)
	}
	req, keys := apiv1.CertificateRequest{CSR: string(csrPEM)}, requestKeys{key: keyPEM}
	if clusterCA {
		caCSR, caKey, err := pki.NewCSR(spiffeID, rand.Reader)
		if err != nil {
			return apiv1.CertificateRequest{}, requestKeys{}, fmt.Errorf("make the cluster CA's CSR: %w", err)
		}
		req.ClusterCACSR, keys.clusterCAKey = string(caCSR), caKey
	}
	return req, keys, nil
}

// errNoClusterCA is wrapped when an answer asked for the cluster's CA
// holds none. Not retryable: the broker must be configured.
var errNoClusterCA = errors.New("the broker signs no cluster CA: run it with --sign-cluster-cas")

// takeClusterCA returns id with the cluster CA of resp and keyPEM, its
// key, checked as identity.withClusterCA does and valid at now.
func takeClusterCA(id *identity, resp *apiv1.CertificateResponse, keyPEM []byte, now time.Time) (*identity, error) {
	if resp.ClusterCA == "" {
		return nil, errNoClusterCA
	}
	return id.withClusterCA([]byte(resp.ClusterCA), keyPEM, now)
}

// clusterCARefused reports whether err is a broker's refusal of a
// request's cluster CA: a 422 whose field error is the clusterCACSR (the
// broker runs without --sign-cluster-cas, or its CA cannot sign one). The
// same request without the cluster CA is not refused for it.
func clusterCARefused(err error) bool {
	var pe *client.ProblemError
	if !errors.As(err, &pe) || pe.Status != http.StatusUnprocessableEntity {
		return false
	}
	return slices.ContainsFunc(pe.Problem.Errors, func(f apiv1.FieldError) bool { return f.Field == fieldClusterCACSR })
}

// fieldClusterCACSR is the request field of the cluster CA's CSR, as a
// broker's field errors name it.
const fieldClusterCACSR = "clusterCACSR"

// renewAPI is the part of the broker API that renewal needs;
// *client.Client implements it.
type renewAPI interface {
	Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)
}

// Renew asks the broker, through c (which authenticates with the current
// certificate in dir), for a new certificate with a new key for the same
// identity, and replaces the files in dir. If dir holds a cluster CA, a
// new one is asked for too. The old files stay if anything fails.
func Renew(ctx context.Context, c *client.Client, dir IdentityDir) (*apiv1.CertificateResponse, error) {
	store := dirStore{dir: dir}
	cur, err := store.load(ctx)
	if err != nil {
		return nil, fmt.Errorf("read current identity: %w", err)
	}
	next, resp, err := renewIdentity(ctx, c, cur, cur.bundlePEM, time.Now(), cur.clusterCA != nil)
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
// with none of it is refused. With wantClusterCA a new cluster CA with a
// new key is asked for too, and the successor is refused without one that
// passes identity.withClusterCA's checks against its new bundle and is
// valid at now; without it the successor has no cluster CA, whatever cur
// had. A broker that signs no cluster CA refuses the whole request
// (clusterCARefused). It stores nothing.
func renewIdentity(ctx context.Context, api renewAPI, cur *identity, trusted []byte, now time.Time, wantClusterCA bool) (*identity, *apiv1.CertificateResponse, error) {
	askCA := wantClusterCA
	req, keys, err := newCertificateRequest(cur.spiffeID, askCA)
	if err != nil {
		return nil, nil, err
	}
	resp, err := api.Renew(ctx, req)
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
	next, err := parseIdentity([]byte(resp.Certificate), keys.key, bundlePEM)
	if err != nil {
		return nil, nil, fmt.Errorf("issued certificate: %w", err)
	}
	if next.spiffeID != cur.spiffeID {
		return nil, nil, fmt.Errorf("renew: the broker issued a certificate for %s, not %s", next.spiffeID, cur.spiffeID)
	}
	if !now.Before(next.leaf().NotAfter) {
		return nil, nil, fmt.Errorf("renew: the issued certificate expired at %s", next.leaf().NotAfter.UTC().Format(time.RFC3339))
	}
	if askCA {
		if next, err = takeClusterCA(next, resp, keys.clusterCAKey, now); err != nil {
			return nil, nil, fmt.Errorf("renew: %w", err)
		}
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
