package agent

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

type fakeJWKSSource struct {
	mu  sync.Mutex
	doc []byte
}

func (f *fakeJWKSSource) JWKS(context.Context) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.doc, nil
}

type fakeJWKSBroker struct {
	uploads [][]byte
	fail    bool
}

func (f *fakeJWKSBroker) PutJWKS(_ context.Context, doc []byte) (*apiv1.PeerJWKS, error) {
	if f.fail {
		return nil, errors.New("broker unavailable")
	}
	f.uploads = append(f.uploads, doc)
	return &apiv1.PeerJWKS{Changed: true}, nil
}

func newJWKSDoc(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	kid, err := pki.KubernetesKeyID(key.Public())
	require.NoError(t, err)
	doc, err := pki.EncodeJWKS(map[string]crypto.PublicKey{kid: key.Public()})
	require.NoError(t, err)
	return doc
}

func TestTheKeySetIsUploadedAtStartOnChangeAndAtResyncOnly(t *testing.T) {
	t.Parallel()
	clk := newFakeClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	src := &fakeJWKSSource{doc: newJWKSDoc(t)}
	b := &fakeJWKSBroker{}
	u := &jwksUploader{source: src, brokers: map[string]jwksAPI{"https://east": b}, interval: time.Minute,
		resync: 10 * time.Minute, clock: clk, log: zap.NewNop(), uploaded: map[string]uploadState{}}
	ctx := context.Background()

	u.syncOnce(ctx)
	require.Len(t, b.uploads, 1, "uploaded at start")
	clk.Step(time.Minute)
	u.syncOnce(ctx)
	require.Len(t, b.uploads, 1, "an unchanged set is not uploaded again before the resync")

	rotated := newJWKSDoc(t)
	src.doc = rotated
	u.syncOnce(ctx)
	require.Len(t, b.uploads, 2, "a changed set is uploaded at once")
	require.Equal(t, rotated, b.uploads[1])

	clk.Step(10 * time.Minute)
	u.syncOnce(ctx)
	require.Len(t, b.uploads, 3, "the resync uploads an unchanged set again")
}

func TestAFailedUploadIsRetriedAtTheNextRead(t *testing.T) {
	t.Parallel()
	clk := newFakeClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	b := &fakeJWKSBroker{fail: true}
	u := &jwksUploader{source: &fakeJWKSSource{doc: newJWKSDoc(t)}, brokers: map[string]jwksAPI{"https://east": b},
		interval: time.Minute, resync: time.Hour, clock: clk, log: zap.NewNop(), uploaded: map[string]uploadState{}}
	u.syncOnce(context.Background())
	require.Empty(t, b.uploads)
	b.fail = false
	u.syncOnce(context.Background())
	require.Len(t, b.uploads, 1)
}

func TestAnUnusableKeySetIsNotUploaded(t *testing.T) {
	t.Parallel()
	b := &fakeJWKSBroker{}
	u := &jwksUploader{source: &fakeJWKSSource{doc: []byte(`{"keys":[]}`)}, brokers: map[string]jwksAPI{"https://east": b},
		interval: time.Minute, resync: time.Hour, clock: newFakeClock(time.Now()), log: zap.NewNop(), uploaded: map[string]uploadState{}}
	u.syncOnce(context.Background())
	require.Empty(t, b.uploads)
}

func TestJWKSUploadIsValidated(t *testing.T) {
	t.Parallel()
	_, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["http://east"], interval: 2h}
`), "")
	require.ErrorContains(t, err, "jwksUpload.brokers[0]")
	require.ErrorContains(t, err, "jwksUpload.interval")
	cfg, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"]}
`), "")
	require.NoError(t, err, "an agent may only upload keys, with no target")
	require.Equal(t, config.DefaultJWKSInterval, time.Duration(cfg.JWKSUpload.Interval))
	require.True(t, cfg.UsesKubernetes())
}
