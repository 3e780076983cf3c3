package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// jwksAPI is what the uploader needs of a broker.
type jwksAPI interface {
	PutJWKS(ctx context.Context, doc []byte) (*apiv1.PeerJWKS, error)
}

// JWKSSource reads this cluster's service-account key set.
type JWKSSource interface {
	JWKS(ctx context.Context) ([]byte, error)
}

// APIServerJWKS reads /openid/v1/jwks through a Kubernetes REST client (a
// discovery client's): the agent runs in the cluster whose keys it
// uploads, so neither a public issuer nor a URL the broker fetches is
// needed. Every authenticated ServiceAccount may read it
// (system:service-account-issuer-discovery).
type APIServerJWKS struct{ Client rest.Interface }

// JWKS implements JWKSSource.
func (s APIServerJWKS) JWKS(ctx context.Context) ([]byte, error) {
	data, err := s.Client.Get().AbsPath("/openid/v1/jwks").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("read /openid/v1/jwks: %w", err)
	}
	return data, nil
}

// jwksUploader keeps brokers supplied with the cluster's key set.
type jwksUploader struct {
	source   JWKSSource
	brokers  map[string]jwksAPI
	interval time.Duration
	resync   time.Duration
	clock    clock.Clock
	log      *zap.Logger

	// uploaded is, per broker, the digest last accepted and when.
	uploaded map[string]uploadState
}

type uploadState struct {
	digest string
	at     time.Time
}

// run uploads at once, then every interval, until ctx is done.
func (u *jwksUploader) run(ctx context.Context) {
	for {
		u.syncOnce(ctx)
		select {
		case <-ctx.Done():
			return
		case <-u.clock.After(u.interval):
		}
	}
}

// syncOnce reads the key set and uploads it to every broker that has not
// accepted this digest, or not within the resync interval.
func (u *jwksUploader) syncOnce(ctx context.Context) {
	doc, err := u.source.JWKS(ctx)
	if err != nil {
		u.log.Warn("cannot read the cluster's key set; retrying", zap.Error(err))
		return
	}
	set, err := pki.ParseJWKS(doc)
	if err != nil {
		u.log.Warn("the cluster's key set is not one a broker accepts", zap.Error(err))
		return
	}
	now := u.clock.Now()
	for url, api := range u.brokers {
		last := u.uploaded[url]
		if last.digest == set.Digest() && now.Sub(last.at) < u.resync {
			continue
		}
		resp, err := api.PutJWKS(ctx, doc)
		var pe *client.ProblemError
		if errors.As(err, &pe) && pe.Status == http.StatusForbidden {
			// Not the live Pods' business: they are reported apart.
			u.log.Warn("the broker takes no key set from this cluster (its policy has no workloadIdentity.jwksFromPeer); if it trusts this cluster's pod certificates alone, set jwksUpload.keys: false",
				zap.String("broker", url), zap.Error(err))
			continue
		}
		if err != nil {
			u.log.Warn("key set upload failed; retrying", zap.String("broker", url), zap.Error(err))
			continue
		}
		u.uploaded[url] = uploadState{digest: set.Digest(), at: now}
		if resp.Changed || last.digest != set.Digest() {
			u.log.Info("key set uploaded", zap.String("broker", url), zap.Bool("changed", resp.Changed),
				zap.Strings("kids", resp.KeyIDs), zap.Strings("previous_kids", resp.PreviousKeyIDs), zap.String("digest", resp.Digest))
		}
	}
}
