package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Per-stream and per-connection buffers of the upstream HTTP/2 client: a
// watch whose client stops reading holds at most this much of the API
// server's stream in the broker before the API server is told to wait
// (HTTP/2 flow control), whatever the client's own window.
const (
	upstreamStreamBuffer = 64 << 10
	upstreamConnBuffer   = 4 << 20
)

// NewTransports returns the transports to the API server of cfg: one over
// HTTP/2 for every request, one over HTTP/1.1 for upgrades. They verify
// the API server as cfg says and carry none of cfg's credentials (no
// bearer token, no client certificate): every forwarded request carries
// the token of its lease's ServiceAccount, and nothing else.
func NewTransports(cfg *rest.Config) (upstream *url.URL, plain, upgrade http.RoundTripper, err error) {
	anon := rest.AnonymousClientConfig(cfg)
	anon.TLSClientConfig.CertData, anon.TLSClientConfig.CertFile = nil, ""
	anon.TLSClientConfig.KeyData, anon.TLSClientConfig.KeyFile = nil, ""
	tlsCfg, err := rest.TLSConfigFor(anon)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("gateway: upstream TLS: %w", err)
	}
	u, _, err := rest.DefaultServerUrlFor(anon)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("gateway: upstream URL: %w", err)
	}
	if u.Scheme != "https" || tlsCfg == nil {
		return nil, nil, nil, errors.New("gateway: the API server must be reached over https")
	}
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}
	h2 := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         dialer.DialContext,
		TLSClientConfig:     tlsCfg.Clone(),
		TLSHandshakeTimeout: 10 * time.Second,
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		HTTP2: &http.HTTP2Config{
			MaxReceiveBufferPerStream:     upstreamStreamBuffer,
			MaxReceiveBufferPerConnection: upstreamConnBuffer,
			SendPingTimeout:               30 * time.Second,
			PingTimeout:                   15 * time.Second,
		},
	}
	h2.Protocols = new(http.Protocols)
	h2.Protocols.SetHTTP2(true)
	h1TLS := tlsCfg.Clone()
	h1TLS.NextProtos = []string{"http/1.1"}
	h1 := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         dialer.DialContext,
		TLSClientConfig:     h1TLS,
		TLSHandshakeTimeout: 10 * time.Second,
		// An upgraded connection is never pooled; a refused upgrade's is.
	}
	h1.Protocols = new(http.Protocols)
	h1.Protocols.SetHTTP1(true)
	return u, h2, h1, nil
}

// TokenTTL is the lifetime of the tokens the gateway forwards with: the
// TokenRequest API's minimum, so that a token copied out of the broker's
// memory is good for ten minutes at most.
const TokenTTL = 10 * time.Minute

// failedTokenRetry is how long a failed TokenRequest's error is answered
// before another is made.
const failedTokenRetry = 5 * time.Second

// maxTokens bounds the leases whose token is kept at once; past it the
// expired ones are dropped, then the soonest to expire.
const maxTokens = 4096

// Tokens keeps one token per lease for the gateway to forward with: made
// with the TokenRequest API when the lease's first request comes, bound
// to the lease Secret (which lives in the ServiceAccount's namespace, as
// the API server requires of a bound object), and made again at two
// thirds of its life. Deleting the lease Secret — its revocation, by
// whatever means — makes the API server refuse the token too, so a token
// copied out of a replica's memory dies with the lease, or within
// TokenTTL, whichever is first. A token is never written anywhere.
type Tokens struct {
	SA    corev1client.ServiceAccountsGetter
	Clock clock.PassiveClock

	mu    sync.Mutex
	cache map[string]*tokenEntry
}

type tokenEntry struct {
	done    chan struct{} // closed once token or err is set
	token   string
	err     error
	renewAt time.Time
	expires time.Time
}

// Token returns the token of lease n, making one if there is none or it
// is due for renewal. Concurrent callers wait on one TokenRequest.
func (t *Tokens) Token(ctx context.Context, n pki.LeaseName) (string, error) {
	key := leaseKey(n.Namespace, secretName(n), types.UID(n.UID))
	now := t.now()
	t.mu.Lock()
	if t.cache == nil {
		t.cache = map[string]*tokenEntry{}
	}
	e := t.cache[key]
	if e != nil {
		select {
		case <-e.done:
			if !now.Before(e.renewAt) {
				e = nil // due (or failed a while ago): make another
			}
		default: // being made
		}
	}
	if e == nil {
		e = &tokenEntry{done: make(chan struct{})}
		t.evictLocked(now)
		t.cache[key] = e
		t.mu.Unlock()
		t.make(ctx, e, n)
	} else {
		t.mu.Unlock()
	}
	select {
	case <-e.done:
	case <-ctx.Done():
		return "", ctx.Err()
	}
	if e.err != nil {
		return "", e.err
	}
	return e.token, nil
}

func (t *Tokens) make(ctx context.Context, e *tokenEntry, n pki.LeaseName) {
	defer close(e.done)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	secs := int64(TokenTTL / time.Second)
	start := t.now()
	bound := &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: secretName(n), UID: types.UID(n.UID)}
	out, err := t.SA.ServiceAccounts(n.Namespace).CreateToken(ctx, n.ServiceAccount, &authnv1.TokenRequest{
		Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &secs, BoundObjectRef: bound},
	}, metav1.CreateOptions{})
	if err == nil && (out.Status.Token == "" || out.Status.ExpirationTimestamp.IsZero()) {
		err = errors.New("the API server returned no token")
	}
	if err != nil {
		// Kept for a moment, so that a ServiceAccount that is gone costs
		// one TokenRequest per failedTokenRetry, not one per request.
		e.err = fmt.Errorf("token for %s/%s (lease %s): %w", n.Namespace, n.ServiceAccount, n.ID, err)
		e.renewAt = start.Add(failedTokenRetry)
		return
	}
	e.token, e.expires = out.Status.Token, out.Status.ExpirationTimestamp.Time
	e.renewAt = start.Add(e.expires.Sub(start) * 2 / 3)
}

// evictLocked makes room for one more entry; t.mu is held.
func (t *Tokens) evictLocked(now time.Time) {
	if len(t.cache) < maxTokens {
		return
	}
	var soonest string
	for k, e := range t.cache {
		select {
		case <-e.done:
		default:
			continue
		}
		if e.err != nil || !now.Before(e.expires) {
			delete(t.cache, k)
			continue
		}
		if soonest == "" || e.expires.Before(t.cache[soonest].expires) {
			soonest = k
		}
	}
	if len(t.cache) >= maxTokens && soonest != "" {
		delete(t.cache, soonest)
	}
}

func (t *Tokens) now() time.Time {
	if t.Clock == nil {
		return time.Now()
	}
	return t.Clock.Now()
}
