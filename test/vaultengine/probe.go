package vaultengine

import (
	"context"
	"fmt"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Probe asks the API server whether a bearer token still authenticates,
// with a SelfSubjectReview: any authenticated user may make one, so the
// answer is 201 while the token is good and 401 once it is refused. It is
// the same question for the broker's tokens and for Vault's.
type Probe struct {
	client kubernetes.Interface
}

// NewProbe returns a probe of token against the API server at host, which
// caData verifies. The probe's client carries the token and nothing else
// (no client certificate), and no client-side limit.
func NewProbe(host string, caData []byte, token string) (*Probe, error) {
	rc := &rest.Config{Host: host, BearerToken: token, QPS: -1, UserAgent: "tokenbroker-bench/probe"}
	rc.TLSClientConfig.CAData = caData
	c, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("build the probe's client: %w", err)
	}
	return &Probe{client: c}, nil
}

// Accepted reports whether the token authenticates now: true on a
// SelfSubjectReview answered, false on 401, an error on anything else.
func (p *Probe) Accepted(ctx context.Context) (bool, error) {
	_, err := p.client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	switch {
	case err == nil:
		return true, nil
	case apierrors.IsUnauthorized(err):
		return false, nil
	default:
		return false, fmt.Errorf("self subject review: %w", err)
	}
}

// WaitRefused polls Accepted every interval until the token is refused
// and returns how long after since that was first seen. It gives up with
// ok false when ctx ends first (a token that is never refused: ctx is the
// patience).
func (p *Probe) WaitRefused(ctx context.Context, since time.Time, interval time.Duration) (d time.Duration, ok bool, err error) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		accepted, err := p.Accepted(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return time.Since(since), false, nil
			}
			return 0, false, err
		}
		if !accepted {
			return time.Since(since), true, nil
		}
		select {
		case <-ctx.Done():
			return time.Since(since), false, nil
		case <-t.C:
		}
	}
}
