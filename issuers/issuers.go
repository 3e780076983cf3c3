// Package issuers holds what every credential issuer shares: the request an
// issuer is given, the credential it returns and the limits it declares.
// The issuers themselves live in sub-packages (tokenrequest, and later a
// CSR-based client-certificate issuer); the broker declares the small
// interface it needs, and the composition root registers the issuers in
// one table (server/issuers.go).
package issuers

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/pki"
)

// The credential kinds, as requests and policies name them (the same
// strings as api/v1's CredentialToken and CredentialClientCertificate).
const (
	KindToken             = "token"
	KindClientCertificate = "clientCertificate"
)

// Request asks for a credential for one ServiceAccount.
type Request struct {
	Namespace      string
	ServiceAccount string
	// TTL is the lifetime asked for, within the issuer's Limits; the API
	// server may shorten it.
	TTL time.Duration
	// Audiences of the credential; empty means the API server's default.
	// Only tokens have audiences.
	Audiences []string
	// CSR is the certificate signing request of a certificate, parsed
	// and checked once by the broker: for a client certificate
	// (pki.ParseUserCSRPEM) the caller's, or one the broker made with a
	// fresh key (the issuer never sees a private key); for a lease
	// certificate (pki.ParseLeaseCSRPEM) the caller's, or nil for a key
	// the issuer makes. For a client certificate, User is the user name
	// it asks for, and Role what that user may do in Namespace.
	CSR  *x509.CertificateRequest
	User string
	Role RoleRef
	// Lease is the broker's record of the credential. An issuer whose
	// credential the API server can bind to an object binds it to the
	// lease (a token: deleting the lease revokes it at once); an issuer
	// that cannot says how revocation works in its Limits.
	Lease ObjectRef
	// LeaseID is the lease's id, and Peer the identity of the peer the
	// credential is for; the lease certificate issuer writes both into
	// the certificate.
	LeaseID, Peer string
}

// RoleRef is a Role or ClusterRole a client certificate's user is bound
// to: Kind "Role" or "ClusterRole".
type RoleRef struct {
	Kind string
	Name string
}

// ObjectRef names the Kubernetes object a credential is bound to.
type ObjectRef struct {
	Kind string
	Name string
	UID  types.UID
}

// Credential is what an issuer produced: a bearer token, or a client
// certificate and its private key, as a kubeconfig's user carries them
// (clientcmd's AuthInfo: token, or client-certificate-data and
// client-key-data). It is secret: never log it.
type Credential struct {
	// Token is a bearer token, for token credentials.
	Token string
	// CertificatePEM is the client certificate (leaf first, then any
	// intermediates) and KeyPEM its private key, for client-certificate
	// credentials.
	CertificatePEM []byte
	KeyPEM         []byte
	// Leaf is CertificatePEM's first certificate, parsed, when the issuer
	// holds it (both issuers do, having checked it): Ref reads it instead
	// of parsing the PEM again. nil means Ref parses CertificatePEM.
	Leaf *x509.Certificate
	// NotBefore is when the credential starts to be valid: zero for a
	// token (at once), the certificate's NotBefore for a certificate
	// (which a signer may backdate).
	NotBefore time.Time
	// ExpiresAt is the expiry the API server granted, which can be earlier
	// than asked for: read from what was issued, never computed.
	ExpiresAt time.Time
}

// Kind is KindClientCertificate for a credential with a certificate, else
// KindToken.
func (c Credential) Kind() string {
	if len(c.CertificatePEM) > 0 {
		return KindClientCertificate
	}
	return KindToken
}

// Ref names a credential in the log and the audit trail without holding
// it: LogKey/Value is a token's jti or a certificate's serial (in
// hexadecimal); APIID is the id the API server logs for every request
// made with it, "" if the credential cannot be parsed.
type Ref struct{ LogKey, Value, APIID string }

// Ref returns c's Ref. APIID is "JTI=<jti>" (the token read without
// verifying it) or "X509SHA256=<lowercase hex sha256 of the leaf's DER>",
// as k8s.io/apiserver's token and x509 authenticators write
// "authentication.kubernetes.io/credential-id".
func (c Credential) Ref() Ref {
	if c.Kind() == KindClientCertificate {
		ref := Ref{LogKey: "certificate_serial"}
		leaf := c.Leaf
		if leaf == nil {
			if certs, err := pki.ParseCertificatesPEM(c.CertificatePEM); err == nil && len(certs) > 0 {
				leaf = certs[0]
			}
		}
		if leaf != nil {
			ref.Value = leaf.SerialNumber.Text(16)
			sum := sha256.Sum256(leaf.Raw)
			ref.APIID = "X509SHA256=" + hex.EncodeToString(sum[:])
		}
		return ref
	}
	ref := Ref{LogKey: "token_jti"}
	if id, err := pki.TokenID(c.Token); err == nil && id != "" {
		ref.Value, ref.APIID = id, "JTI="+id
	}
	return ref
}

// Limits is what an issuer declares about the credentials it mints.
type Limits struct {
	// MinTTL is the shortest lifetime the API server grants; a shorter
	// TTL is raised to it and reported with MinClampedBy.
	MinTTL       time.Duration
	MinClampedBy string
	// MaxTTL, if not zero, is the longest lifetime the issuer can give; a
	// longer TTL is lowered to it and reported with MaxClampedBy.
	MaxTTL       time.Duration
	MaxClampedBy string
	// Revocation says how a credential is revoked before it expires, for
	// the docs, whoami and the audit log: RevokedByLease when deleting
	// the lease object is enough.
	Revocation string
}

// How credentials are revoked (Limits.Revocation).
const (
	// RevokedByLease: the API server refuses the credential once the lease
	// object it is bound to is deleted (a bound ServiceAccount token).
	RevokedByLease = "lease"
	// RevokedByRoleBinding: the credential's user has no permission but
	// through a RoleBinding owned by the lease object, which goes with it
	// (a client certificate, which Kubernetes cannot revoke itself).
	RevokedByRoleBinding = "rolebinding"
)

// Clamp bounds ttl by the limits and says which one decided ("" if
// none).
func (l Limits) Clamp(ttl time.Duration) (time.Duration, string) {
	switch {
	case l.MaxTTL > 0 && ttl > l.MaxTTL:
		return l.MaxTTL, l.MaxClampedBy
	case ttl < l.MinTTL:
		return l.MinTTL, l.MinClampedBy
	}
	return ttl, ""
}
