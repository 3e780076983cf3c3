// Package tokenrequest issues ServiceAccount tokens with the Kubernetes
// TokenRequest API, bound to a lease object so that deleting the object
// revokes the token.
package tokenrequest

import (
	"context"
	"errors"
	"fmt"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/tokenbroker/tokenbroker/issuers"
)

// Issuer mints bound ServiceAccount tokens.
type Issuer struct {
	sa corev1client.ServiceAccountsGetter
}

// New returns an Issuer that calls TokenRequest through sa.
func New(sa corev1client.ServiceAccountsGetter) *Issuer { return &Issuer{sa: sa} }

// MinTTL is the shortest lifetime the TokenRequest API accepts
// (expirationSeconds ≥ 600).
const MinTTL = 10 * time.Minute

// ClampedByMinimum reports a TTL raised to MinTTL.
const ClampedByMinimum = "tokenrequest.minimum"

// Kind is issuers.KindToken.
func (*Issuer) Kind() string { return issuers.KindToken }

// Limits: at least ten minutes, no maximum of its own (the API server's
// --service-account-max-token-expiration may shorten a token, which the
// broker reports), revoked by deleting the lease the token is bound to.
func (*Issuer) Limits() issuers.Limits {
	return issuers.Limits{MinTTL: MinTTL, MinClampedBy: ClampedByMinimum, Revocation: issuers.RevokedByLease}
}

// Issue creates a token for req.ServiceAccount bound to req.Lease. Errors
// from the API server are returned wrapped, unclassified; a transport error
// or a 5xx is retryable, a 4xx is not.
func (i *Issuer) Issue(ctx context.Context, req issuers.Request) (issuers.Credential, error) {
	if req.Lease.Name == "" || req.Lease.UID == "" {
		// An unbound token could not be revoked; refuse to make one.
		return issuers.Credential{}, errors.New("tokenrequest: a lease object to bind to is required")
	}
	seconds := int64(req.TTL / time.Second)
	tr := &authnv1.TokenRequest{
		Spec: authnv1.TokenRequestSpec{
			Audiences:         req.Audiences,
			ExpirationSeconds: &seconds,
			BoundObjectRef: &authnv1.BoundObjectReference{
				Kind:       req.Lease.Kind,
				APIVersion: "v1",
				Name:       req.Lease.Name,
				UID:        req.Lease.UID,
			},
		},
	}
	out, err := i.sa.ServiceAccounts(req.Namespace).CreateToken(ctx, req.ServiceAccount, tr, metav1.CreateOptions{})
	if err != nil {
		return issuers.Credential{}, fmt.Errorf("create token request: %w", err)
	}
	if out.Status.Token == "" || out.Status.ExpirationTimestamp.IsZero() {
		return issuers.Credential{}, errors.New("create token request: the API server returned no token or no expiry")
	}
	return issuers.Credential{Token: out.Status.Token, ExpiresAt: out.Status.ExpirationTimestamp.Time}, nil
}
