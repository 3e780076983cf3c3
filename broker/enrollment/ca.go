package enrollment

import (
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// CertificateAuthority signs client certificates for enrolled and renewing
// clusters; *pki.CA is the implementation.
type CertificateAuthority interface {
	// SignClient issues a client certificate for identity with the CSR's
	// public key. Errors wrapping pki.ErrInvalidCSR are the caller's fault;
	// none is retryable.
	SignClient(csr *x509.CertificateRequest, identity string, lifetime time.Duration) (*pki.KeyPair, error)
	// Certificate is the signing CA's certificate; its key signs join
	// tokens.
	Certificate() *x509.Certificate
}

// ClusterCASigner is the optional ability of a CertificateAuthority to
// sign the CAs of clusters (fleet CA → cluster CA → pod certificates);
// *pki.CA and *pki.CAReloader have it.
type ClusterCASigner interface {
	// SignClusterCA signs a cluster CA for clusterIdentity with the CSR's
	// public key. Errors wrapping pki.ErrInvalidCSR are the caller's;
	// none is retryable.
	SignClusterCA(csr *x509.CertificateRequest, clusterIdentity string, lifetime time.Duration) (*pki.KeyPair, error)
	// CheckSignsClusterCAs fails, wrapping pki.ErrCannotSignCAs, when
	// the CA's path length allows no CA below it.
	CheckSignsClusterCAs() error
}

// TrustSource is the CA bundle in force, which peers use to verify brokers
// and each other; *pki.PoolReloader (the client-CA bundle, which follows
// its file) is the implementation.
type TrustSource interface {
	// PEM is the bundle as served by GET /v1/trust-bundle.
	PEM() []byte
	// Certificates are the bundle's certificates, in the same order.
	Certificates() []*x509.Certificate
}

// JoinTokenVerifier checks a join token's signature and claims (not its
// single use, which the broker records); *pki.JoinTokenVerifier is the
// implementation.
type JoinTokenVerifier interface {
	Verify(token string) (pki.JoinTokenClaims, error)
}

var (
	_ CertificateAuthority = (*pki.CA)(nil)
	_ CertificateAuthority = (*pki.CAReloader)(nil)
	_ ClusterCASigner      = (*pki.CA)(nil)
	_ ClusterCASigner      = (*pki.CAReloader)(nil)
	_ TrustSource          = (*pki.PoolReloader)(nil)
	_ JoinTokenVerifier    = (*pki.JoinTokenVerifier)(nil)
	_ JoinTokenVerifier    = caJoinTokens{}
	_ CACertificates       = (*pki.PoolReloader)(nil)
)

// CACertificates are CA certificates read at every use, so that they
// follow a file that changes; *pki.PoolReloader is the implementation.
type CACertificates interface {
	Certificates() []*x509.Certificate
}

// caJoinTokens verifies join tokens with the key of the signing CA in
// force and, during a rotation, of the previous signing CA named
// explicitly, both read at every verification so that they follow a
// signing CA that is replaced at run time. The other CAs of the trust
// bundle are not asked: a bundle CA authenticates peers, it does not
// admit new ones, and an operator who adds a partner's CA to the bundle
// must not thereby let that partner mint join tokens for this broker.
//
// The token's aud must name this broker (see Config.BrokerNames).
type caJoinTokens struct {
	ca        CertificateAuthority
	previous  CACertificates
	audiences func() []string
	now       func() time.Time
}

// NewCAJoinTokens verifies join tokens signed by ca or previous, for one
// of the audiences, at now.
func NewCAJoinTokens(ca CertificateAuthority, previous CACertificates, audiences func() []string, now func() time.Time) JoinTokenVerifier {
	return caJoinTokens{ca: ca, previous: previous, audiences: audiences, now: now}
}

func (v caJoinTokens) Verify(token string) (pki.JoinTokenClaims, error) {
	return pki.NewJoinTokenVerifierFor(SigningCAs(v.ca, v.previous), v.audiences(), v.now).Verify(token)
}

// signingCAs are the CAs whose keys may have signed join tokens and the
// client certificates that renew: the signing CA in force and the
// previous one.
func SigningCAs(ca CertificateAuthority, previous CACertificates) []*x509.Certificate {
	out := []*x509.Certificate{ca.Certificate()}
	if previous != nil {
		out = append(out, previous.Certificates()...)
	}
	return out
}

// UsedJoinTokenSecretName returns the name of the record of a used join
// token: a hash of the jti, so that the name is always valid whatever the
// jti looks like.
func UsedJoinTokenSecretName(jti string) string {
	sum := sha256.Sum256([]byte(jti))
	return usedJoinTokenPrefix + hex.EncodeToString(sum[:])[:usedJoinTokenNameHexDigits]
}

// parseCSR parses the CSR and checks that it asks for identity.
func ParseCSR(csrPEM, identity string) (*x509.CertificateRequest, error) {
	csr, csrIdentity, err := pki.ParseCSRPEM([]byte(csrPEM))
	if err != nil {
		return nil, &problem.Error{
			Kind:   problem.KindInvalid,
			Detail: "the request is invalid",
			Fields: []apiv1.FieldError{{Field: "csr", Detail: CSRProblem(err)}},
			Err:    err,
		}
	}
	if csrIdentity != identity {
		return nil, &problem.Error{Kind: problem.KindForbidden, Detail: errIdentityMismatch.Detail,
			Err: fmt.Errorf("CSR identity %q, authenticated identity %q", csrIdentity, identity)}
	}
	return csr, nil
}

// fieldClusterCACSR is the request field of a cluster CA's CSR.
const fieldClusterCACSR = "clusterCACSR"

// errClusterCAsDisabled refuses a clusterCACSR on a broker that does not
// sign cluster CAs: the whole request, so that a cluster never believes it
// has a CA it was not given.
var errClusterCAsDisabled = &problem.Error{Kind: problem.KindUnprocessable, Detail: "this broker does not sign cluster CAs",
	Fields: []apiv1.FieldError{{Field: fieldClusterCACSR,
		Detail: "this broker does not sign cluster CAs (tokenbroker serve --sign-cluster-cas); send the request without it"}}}

// parseClusterCACSR parses a cluster CA's CSR and checks it as ParseCSR
// does the client certificate's (same identity), and that it is for
// another key than client's: a CA key is not a TLS client key.
func parseClusterCACSR(csrPEM, identity string, client *x509.CertificateRequest) (*x509.CertificateRequest, error) {
	csr, csrIdentity, err := pki.ParseCSRPEM([]byte(csrPEM))
	if err != nil {
		return nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid",
			Fields: []apiv1.FieldError{{Field: fieldClusterCACSR, Detail: clusterCACSRProblem(err)}}, Err: err}
	}
	if csrIdentity != identity {
		return nil, &problem.Error{Kind: problem.KindForbidden, Detail: errIdentityMismatch.Detail,
			Err: fmt.Errorf("cluster CA CSR identity %q, authenticated identity %q", csrIdentity, identity)}
	}
	if pub, ok := csr.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); ok && pub.Equal(client.PublicKey) {
		return nil, problem.Invalid(apiv1.FieldError{Field: fieldClusterCACSR, Detail: "must be for another key than csr"})
	}
	return csr, nil
}

// clusterCACSRProblem is CSRProblem for the cluster CA's CSR.
func clusterCACSRProblem(err error) string {
	return strings.Replace(CSRProblem(err), "cluster identity", "cluster identity (the same as csr's)", 1)
}

// cSRProblem is the caller-facing description of a refused CSR: pki's
// messages describe the CSR and hold nothing secret, but are bounded here
// all the same.
func CSRProblem(err error) string {
	const maxLen = 300
	msg := err.Error()
	if len(msg) > maxLen {
		msg = msg[:maxLen] + "…"
	}
	return "must be one PEM CERTIFICATE REQUEST with the cluster identity as its only URI SAN: " + msg
}

// The record of a used join token: a Secret with no data in the broker's
// namespace, named after the token's jti, so that creating it is the
// atomic "first use wins" that every replica agrees on.
const (
	AnnotationJoinTokenID      = "tokenbroker.io/jti"
	usedJoinTokenPrefix        = "tokenbroker-jti-"
	usedJoinTokenNameHexDigits = 40
	// usedJoinTokenMargin keeps a record past its token's exp, so that the
	// GC never deletes it while the verifier's leeway (and clock skew
	// between replicas) could still accept the token.
	UsedJoinTokenMargin = 10 * time.Minute
	// usedJoinTokenFallbackRetention is how long the GC keeps a record
	// whose expiry annotation cannot be read: beyond the longest join token.
	UsedJoinTokenFallbackRetention = pki.MaxJoinTokenTTL + UsedJoinTokenMargin
)

// errIdentityMismatch is the refusal of a CSR for another identity than the
// one the join token or the client certificate vouches for.
var errIdentityMismatch = problem.Errorf(problem.KindForbidden, "the CSR's identity is not the authenticated identity")
