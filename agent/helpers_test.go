package agent

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"k8s.io/apimachinery/pkg/runtime"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// t0 is the fake clock's start.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// fakeClock moves only when told (SetTime, Step) and counts the timers
// waiting on it (Waiters).
type fakeClock = clocktesting.FakeClock

func newFakeClock(t time.Time) *fakeClock { return clocktesting.NewFakeClock(t) }

// fixedRand always returns v.
type fixedRand float64

func (r fixedRand) Float64() float64 { return float64(r) }

// leaseID returns a valid lease id (26 characters of a-z2-7) for n.
func leaseID(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz234567"
	b := []byte(strings.Repeat("a", 26))
	for i := 25; i >= 0 && n > 0; i-- {
		b[i] = alphabet[n%32]
		n /= 32
	}
	return string(b)
}

// testCA is a fixed PEM "CA bundle" for kubeconfigs; outputs do not parse it.
const testCA = "-----BEGIN CERTIFICATE-----\nMIIBdGVzdCBjYQ==\n-----END CERTIFICATE-----\n"

// testKubeconfig is a kubeconfig as the broker builds it.
func testKubeconfig(server, token string) string {
	return fmt.Sprintf(`apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: %s
    server: %s
  name: east
contexts:
- context:
    cluster: east
    namespace: argo
    user: admiralty-source@east
  name: argo/admiralty-source@east
current-context: argo/admiralty-source@east
kind: Config
users:
- name: admiralty-source@east
  user:
    token: %s
`, b64(testCA), server, token)
}

// fakeBroker answers the refresher's calls from a script and records them.
type fakeBroker struct {
	mu      sync.Mutex
	now     func() time.Time
	ttl     time.Duration
	n       int
	fail    error // if set, Kubeconfig fails with it
	revoked []string
	revErr  error
	calls   []string
}

func newFakeBroker(now func() time.Time, ttl time.Duration) *fakeBroker {
	return &fakeBroker{now: now, ttl: ttl}
}

func (b *fakeBroker) WhoAmI(context.Context) (*apiv1.WhoAmI, error) {
	return &apiv1.WhoAmI{Identity: "spiffe://oc.example/cluster/west", Peer: "west"}, nil
}

func (b *fakeBroker) Kubeconfig(_ context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls = append(b.calls, "kubeconfig")
	if b.fail != nil {
		return nil, b.fail
	}
	b.n++
	id := leaseID(b.n)
	token := fmt.Sprintf("token-%d-SECRET", b.n)
	return &apiv1.KubeconfigResponse{
		LeaseID:      id,
		Kubeconfig:   testKubeconfig("https://east.example.com:6443", token),
		Token:        token,
		ExpiresAt:    b.now().Add(b.ttl),
		RequestedTTL: req.TTL,
		GrantedTTL:   b.ttl.String(),
	}, nil
}

func (b *fakeBroker) RevokeLease(_ context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls = append(b.calls, "revoke "+id)
	if b.revErr != nil {
		return b.revErr
	}
	b.revoked = append(b.revoked, id)
	return nil
}

func (b *fakeBroker) setFail(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fail = err
}

func (b *fakeBroker) revokedLeases() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.revoked...)
}

func (b *fakeBroker) issued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

var errBrokerDown = &client.ProblemError{Status: http.StatusServiceUnavailable, Problem: apiv1.Problem{Title: "Service Unavailable"}}

// refresherFixture is a refresher on a fake clock and a fake broker.
type refresherFixture struct {
	r      *refresher
	clock  *fakeClock
	broker *fakeBroker
	reg    *prometheus.Registry
	logs   *observer.ObservedLogs
}

func newRefresherFixture(t *testing.T, rc config.RefreshConfig, outs ...output) *refresherFixture {
	t.Helper()
	clock := newFakeClock(t0)
	fb := newFakeBroker(clock.Now, time.Hour)
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	core, logs := observer.New(zap.DebugLevel)
	rc.Fill(config.RefreshConfig{Fraction: config.DefaultFraction, Jitter: config.DefaultJitter, MinBackoff: brokerDuration(config.DefaultMinBackoff),
		MaxBackoff: brokerDuration(config.DefaultMaxBackoff), RevokeGrace: brokerDuration(time.Minute)}) // the tests count in minutes of a 1h token
	req := config.RequestConfig{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"}
	r := &refresher{
		name:    "east",
		req:     req,
		meta:    outputMeta{target: "east", request: requestDigest("https://east.example.com:8443", req)},
		api:     fb,
		outputs: outs,
		sched:   newSchedule(rc, fixedRand(0)),
		grace:   time.Duration(rc.RevokeGrace),
		clock:   clock,
		log:     zap.New(core),
		metrics: m,
	}
	m.initTarget("east", outs)
	t.Cleanup(func() {
		for _, e := range logs.All() {
			for _, needle := range []string{"SECRET", "token:"} {
				require.NotContains(t, fmt.Sprint(e.Message, e.ContextMap()), needle, "a log line leaks a credential")
			}
		}
	})
	return &refresherFixture{r: r, clock: clock, broker: fb, reg: reg, logs: logs}
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func brokerDuration(d time.Duration) apiv1.Duration { return apiv1.Duration(d) }

// memOutput is an output in memory that can be told to fail.
type memOutput struct {
	name   string
	mu     sync.Mutex
	held   *stored
	fail   error
	writes int
}

func (o *memOutput) String() string { return "mem:" + o.name }

func (o *memOutput) write(_ context.Context, meta outputMeta, c *Credential) (bool, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.fail != nil {
		return false, o.fail
	}
	if o.held != nil && o.held.leaseID == c.LeaseID {
		return false, nil
	}
	o.writes++
	o.held = &stored{grant: c.grant(), target: meta.target, request: meta.request, kubeconfig: c.Kubeconfig}
	return true, nil
}

func (o *memOutput) read(context.Context) (*stored, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.held == nil {
		return nil, nil
	}
	cp := *o.held
	return &cp, nil
}

func (o *memOutput) lease() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.held == nil {
		return ""
	}
	return o.held.leaseID
}

func (o *memOutput) setFail(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.fail = err
}

type (
	apiv1KubeconfigResponse = apiv1.KubeconfigResponse
	runtimeObject           = runtime.Object
)

// exampleConfig is the complete example of the configuration file
// (config/testdata/example.yaml), which the guides quote.
func exampleConfig(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("config", "testdata", "example.yaml"))
	require.NoError(t, err)
	return b
}
