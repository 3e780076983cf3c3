// Package issuers holds what every credential issuer shares: the request an
// issuer is given and the credential it returns. The issuers themselves
// live in sub-packages (tokenrequest, and later clientcert); the broker
// declares the small interface it needs and the composition root picks the
// issuers explicitly.
package issuers

import (
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Request asks for a credential for one ServiceAccount.
type Request struct {
	Namespace      string
	ServiceAccount string
	// TTL is the lifetime asked for; the API server may shorten it.
	TTL time.Duration
	// Audiences of the credential; empty means the API server's default.
	Audiences []string
	// Lease is the object the credential is bound to: deleting it revokes
	// the credential.
	Lease ObjectRef
}

// ObjectRef names the Kubernetes object a credential is bound to.
type ObjectRef struct {
	Kind string
	Name string
	UID  types.UID
}

// Credential is what an issuer produced. It is secret: never log it.
type Credential struct {
	// Token is a bearer token, for token credentials.
	Token string
	// ExpiresAt is the expiry the API server granted, which can be earlier
	// than asked for.
	ExpiresAt time.Time
}
