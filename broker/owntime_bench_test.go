package broker

import (
	"context"
	"io"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// BenchmarkIssueOwnTime is the broker's own work per token issuance on
// one core, for a profile (-cpuprofile): an API server that answers at
// once and keeps nothing, the limits out of the way, logs encoded as
// the chart's info level writes them. own-µs/op is what
// tokenbroker_issuance_own_seconds records; make bench measures it
// under load, against a real API server.
func BenchmarkIssueOwnTime(b *testing.B) {
	e, reg, _ := newMetricsEnv(b)
	e.b.cfg.Policy = policy.NewStore(mustPolicy(b, strings.Replace(testPolicy, "ttl:",
		"limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 1000000}\nttl:", 1)))
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	e.b.cfg.Logger = zap.New(zapcore.NewCore(enc, zapcore.AddSync(io.Discard), zap.InfoLevel))
	e.client.PrependReactor("*", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if c, ok := a.(k8stesting.CreateAction); ok {
			s := c.GetObject().(*corev1.Secret).DeepCopy()
			s.UID = "uid-1"
			return true, s, nil
		}
		return true, &corev1.Secret{}, nil
	})
	ctx := context.Background()
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h"}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := e.b.IssueKubeconfig(ctx, west, req); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(histogramSum(b, reg, "tokenbroker_issuance_own_seconds")/float64(b.N)*1e6, "own-µs/op")
}
