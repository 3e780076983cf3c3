package broker

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"
)

const oneEnrollmentPolicy = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {enrollmentsPerMinute: 1}
`

func TestTheEnrollmentLimiterChecksTheSourceFirstAndKeysIPv6ByItsSlash64(t *testing.T) {
	t.Parallel()
	type try struct {
		addr, token string
		refused     bool
	}
	for _, tc := range []struct {
		name  string
		tries []try
	}{
		{"Junk tokens from one address are refused before any bucket is made for them, so the token is still fresh from another address.", []try{
			{"192.0.2.1", "token-a", false},
			{"192.0.2.1", "token-b", true},
			{"192.0.2.2", "token-b", false},
		}},
		{"Two IPv6 addresses in one /64 share a bucket.", []try{
			{"2001:db8:1:2::1", "token-a", false},
			{"2001:db8:1:2:ffff:ffff:ffff:9", "token-b", true},
			{"2001:db8:1:3::1", "token-c", false},
		}},
		{"An IPv4-mapped IPv6 address is its IPv4 address.", []try{
			{"192.0.2.7", "token-a", false},
			{"::ffff:192.0.2.7", "token-b", true},
		}},
		{"A join token used from a second address is still limited.", []try{
			{"192.0.2.1", "token-a", false},
			{"192.0.2.9", "token-a", true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, _ := newLimitsEnv(t, oneEnrollmentPolicy)
			for i, tr := range tc.tries {
				err := e.b.admission().Enrollment(e.b.cfg.Policy.Load(), tr.addr, tr.token, nil)
				if tr.refused {
					require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "try %d", i)
				} else {
					require.NoError(t, err, "try %d", i)
				}
			}
		})
	}
}

func TestTheEnrollmentLimiterNeverHoldsMoreThanItsBound(t *testing.T) {
	t.Parallel()
	e, clk := newLimitsEnv(t, oneEnrollmentPolicy)
	// A source that used its one enrollment, then far more sources each
	// with a junk token than the bound.
	require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "198.51.100.1", "first", nil))
	for i := range 3 * limits.MaxEnrollBuckets / 2 {
		require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), junkAddr(i), fmt.Sprintf("junk-%d", i), nil))
		require.LessOrEqual(t, e.b.enrollLim.Len(), limits.MaxEnrollBuckets)
	}
	require.Equal(t, limits.MaxEnrollBuckets, e.b.enrollLim.Len())
	require.Positive(t, e.b.enrollLim.Evicted, "nothing refilled: the oldest went")

	// Once buckets are full again they are dropped instead of evicting
	// the limited ones.
	clk.Step(time.Minute)
	evicted := e.b.enrollLim.Evicted
	for i := range 100 {
		require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), junkAddr(1_000_000+i), fmt.Sprintf("late-%d", i), nil))
	}
	require.Equal(t, evicted, e.b.enrollLim.Evicted)
	require.LessOrEqual(t, e.b.enrollLim.Len(), limits.MaxEnrollBuckets)
}

// junkAddr is the i-th of 16M distinct IPv4 addresses.
func junkAddr(i int) string {
	return netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()
}

// BenchmarkEnrollmentJunkTokens is the limiter's cost of an enrollment
// with a new junk join token from a new address, with keys junk tokens
// already seen and none refilled (the clock stands still): the attack of
// issue #27. It should not grow with keys (make bench).
func BenchmarkEnrollmentJunkTokens(b *testing.B) {
	for _, keys := range []int{1_000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("keys=%d", keys), func(b *testing.B) {
			clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
			p, err := policy.Parse([]byte(oneEnrollmentPolicy))
			require.NoError(b, err)
			bk, err := New(Config{Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(p), Logger: zap.NewNop(), Clock: clk})
			require.NoError(b, err)
			for i := range keys {
				_ = bk.admission().Enrollment(bk.cfg.Policy.Load(), junkAddr(i), fmt.Sprintf("junk-%d", i), nil)
			}
			i := keys
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				_ = bk.admission().Enrollment(bk.cfg.Policy.Load(), junkAddr(i), fmt.Sprintf("junk-%d", i), nil)
				i++
			}
		})
	}
}
