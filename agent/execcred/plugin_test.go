package execcred

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/agent/client"
)

// t0 is the fake clock's start.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// testKey is the key of the tests' credentials.
var testKey = Key{Broker: "https://east.example.com:8443", Identity: "spiffe://oc.example/cluster/west",
	Namespace: "argo", ServiceAccount: "runner", Audiences: []string{"b", "a"}, TTL: "1h"}

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

// fakeIssuer stands in for the broker: each issuance is a new lease whose
// token expires ttl after the fake clock's now.
type fakeIssuer struct {
	clock *clocktesting.FakeClock
	ttl   time.Duration
	n     atomic.Int32
	fail  atomic.Pointer[error]
}

func (f *fakeIssuer) issue(context.Context) (*Credential, error) {
	if err := f.fail.Load(); err != nil {
		return nil, *err
	}
	n := f.n.Add(1)
	now := f.clock.Now()
	return &Credential{
		LeaseID:    leaseID(int(n)),
		Token:      fmt.Sprintf("token-%d-SECRET", n),
		ObtainedAt: now,
		ExpiresAt:  now.Add(f.ttl),
	}, nil
}

func (f *fakeIssuer) issued() int { return int(f.n.Load()) }

// pluginFixture is a Plugin on a fake clock with a cache in a fresh
// directory, and the warnings it gave.
type pluginFixture struct {
	p      *Plugin
	clock  *clocktesting.FakeClock
	issuer *fakeIssuer
	mu     sync.Mutex
	warned []error
}

func newPluginFixture(t *testing.T) *pluginFixture {
	t.Helper()
	cache, err := OpenCache(filepath.Join(t.TempDir(), "tokenbroker"))
	require.NoError(t, err)
	clock := clocktesting.NewFakeClock(t0)
	f := &pluginFixture{clock: clock, issuer: &fakeIssuer{clock: clock, ttl: time.Hour}}
	f.p = &Plugin{Clock: clock, Cache: cache, Warn: func(err error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.warned = append(f.warned, err)
	}}
	return f
}

func (f *pluginFixture) get(t *testing.T, parent Parent) (*Credential, Outcome) {
	t.Helper()
	c, outcome, err := f.p.Get(context.Background(), testKey, parent, f.issuer.issue)
	require.NoError(t, err)
	return c, outcome
}

var kubectl1, kubectl2 = Parent{PID: 4711, StartTime: 100}, Parent{PID: 4712, StartTime: 101}

func TestTheCacheHandsOutOneCredentialUntilItsRefreshPoint(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	first, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeMiss, outcome)
	require.Equal(t, t0.Add(39*time.Minute+36*time.Second), first.RefreshAt, "0.66 of an hour")
	require.Equal(t, first.RefreshAt, first.Status().Expiration, "client-go is told to come back at the refresh point")

	f.clock.SetTime(first.RefreshAt.Add(-time.Second))
	again, outcome := f.get(t, kubectl2)
	require.Equal(t, OutcomeHit, outcome, "another kubectl a second before the refresh point")
	require.Equal(t, first.Token, again.Token)
	require.Equal(t, first.RefreshAt, again.RefreshAt)
	require.Equal(t, 1, f.issuer.issued())

	f.clock.SetTime(first.RefreshAt)
	fresh, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeRefresh, outcome, "at the refresh point, even for a process it was handed to")
	require.NotEqual(t, first.Token, fresh.Token)
	require.Equal(t, 2, f.issuer.issued())
	require.Empty(t, f.warned)
}

func TestTheRefreshFractionSetsTheRefreshPoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		fraction float64
		life     time.Duration
		want     time.Duration
	}{
		{name: "no fraction means two thirds (0.66)", life: time.Hour, want: 39*time.Minute + 36*time.Second},
		{name: "a tenth of ten minutes is one minute", fraction: 0.1, life: 10 * time.Minute, want: time.Minute},
		{name: "the point is rounded down to whole seconds, as client-go reads it", fraction: 0.5, life: 3 * time.Second, want: time.Second},
		{name: "a fraction out of range is the default", fraction: 1.5, life: time.Hour, want: 39*time.Minute + 36*time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPluginFixture(t)
			f.p.RefreshFraction = tc.fraction
			f.issuer.ttl = tc.life
			c, _ := f.get(t, Parent{})
			require.Equal(t, t0.Add(tc.want), c.RefreshAt)
		})
	}
}

func TestRefreshPointOfALifeTooShortForAWholeSecondIsTheExpiry(t *testing.T) {
	t.Parallel()
	obtained := t0.Add(300 * time.Millisecond)
	require.Equal(t, obtained.Add(time.Second), RefreshPoint(obtained, obtained.Add(time.Second), 0.5))
}

func TestTheSameProcessAskingAgainBeforeTheRefreshPointHadItsCredentialRefused(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	first, _ := f.get(t, kubectl1)
	f.clock.Step(time.Minute)
	_, outcome := f.get(t, kubectl2)
	require.Equal(t, OutcomeHit, outcome)

	// kubectl1's request got 401 (the lease was revoked): client-go runs
	// the plugin again in the same process.
	f.clock.Step(time.Minute)
	fresh, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeRefused, outcome)
	require.NotEqual(t, first.Token, fresh.Token)
	require.Equal(t, f.clock.Now().Add(39*time.Minute+36*time.Second), fresh.RefreshAt)

	// kubectl2 meets the refusal later: the fresh credential was never
	// handed to it, so it gets it.
	again, outcome := f.get(t, kubectl2)
	require.Equal(t, OutcomeHit, outcome)
	require.Equal(t, fresh.Token, again.Token)
	require.Equal(t, 2, f.issuer.issued())
}

func TestAProcessWithARecycledPIDIsNotTakenForTheOneServed(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	f.get(t, kubectl1)
	_, outcome := f.get(t, Parent{PID: kubectl1.PID, StartTime: kubectl1.StartTime + 1})
	require.Equal(t, OutcomeHit, outcome)
}

func TestAPersonRunningTheCommandTwiceIsNotARefusal(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	f.get(t, Parent{})
	_, outcome := f.get(t, Parent{})
	require.Equal(t, OutcomeHit, outcome, "without client-go's request no parent is recorded")
	require.Equal(t, 1, f.issuer.issued())
}

func TestARefusedCredentialIsDroppedEvenWhenTheBrokerCannotBeReached(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	f.get(t, kubectl1)
	down := errors.New("broker https://east.example.com:8443: connection refused")
	f.issuer.fail.Store(&down)
	_, outcome, err := f.p.Get(context.Background(), testKey, kubectl1, f.issuer.issue)
	require.ErrorIs(t, err, down)
	require.Equal(t, OutcomeRefused, outcome)
	_, err = os.Stat(f.p.Cache.Path(testKey.ID()))
	require.ErrorIs(t, err, os.ErrNotExist, "the refused credential is never handed out again")

	f.issuer.fail.Store(nil)
	_, outcome = f.get(t, kubectl2)
	require.Equal(t, OutcomeMiss, outcome)
}

func TestOnlyTheLastParentsAreRemembered(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	for pid := 1000; pid < 1000+maxServedTo+4; pid++ {
		f.get(t, Parent{PID: pid})
	}
	e, state, err := f.p.Cache.load(testKey.ID())
	require.NoError(t, err)
	require.Equal(t, stateFound, state)
	require.Len(t, e.ServedTo, maxServedTo)
	require.Equal(t, Parent{PID: 1000 + maxServedTo + 3}, e.ServedTo[maxServedTo-1], "the most recent last")
	require.Equal(t, 1, f.issuer.issued())
}

func TestTheCacheFileIsPrivateAndHoldsWhatTheSpecSays(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	c, _ := f.get(t, kubectl1)
	dir, err := os.Stat(f.p.Cache.Dir())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), dir.Mode().Perm())
	path := f.p.Cache.Path(testKey.ID())
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	require.Equal(t, filepath.Join(f.p.Cache.Dir(), testKey.ID()+".json"), path, "one file per key")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	for _, field := range []string{`"version":1`, `"leaseId":"` + c.LeaseID + `"`, `"token":"` + c.Token + `"`, `"expiresAt":"2030-01-02T04:04:05Z"`,
		`"obtainedAt":"2030-01-02T03:04:05Z"`, `"refreshAt":"2030-01-02T03:43:41Z"`, `"broker":"https://east.example.com:8443"`, `"servedTo":[{"pid":4711,"startTime":100}]`} {
		require.Contains(t, string(data), field)
	}
	entries, err := os.ReadDir(f.p.Cache.Dir())
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	require.ElementsMatch(t, []string{testKey.ID() + ".json", testKey.ID() + ".lock"}, names, "no temporary file is left")
}

func TestKeysTellRequestsApart(t *testing.T) {
	t.Parallel()
	same := testKey
	same.Audiences = []string{"a", "b", "a"}
	require.Equal(t, testKey.ID(), same.ID(), "audiences are a set")
	for name, change := range map[string]func(*Key){
		"broker":          func(k *Key) { k.Broker += "x" },
		"identity":        func(k *Key) { k.Identity = "spiffe://oc.example/cluster/south" },
		"namespace":       func(k *Key) { k.Namespace = "other" },
		"service account": func(k *Key) { k.ServiceAccount = "other" },
		"credential":      func(k *Key) { k.Credential = "clientCertificate" },
		"audiences":       func(k *Key) { k.Audiences = []string{"a"} },
		"ttl":             func(k *Key) { k.TTL = "2h" },
		"min ttl":         func(k *Key) { k.MinTTL = "1h" },
		"access gateway":  func(k *Key) { k.Access = "gateway" },
		"access direct":   func(k *Key) { k.Access = "direct" },
		"fields that run together": func(k *Key) {
			k.Namespace, k.ServiceAccount = "argor", "unner"
		},
	} {
		k := testKey
		change(&k)
		require.NotEqual(t, testKey.ID(), k.ID(), name)
	}
	gw, direct := testKey, testKey
	gw.Access, direct.Access = "gateway", "direct"
	require.NotEqual(t, gw.ID(), direct.ID(), "a gateway credential is never handed out for a direct request")
}

// The entries written before access modes keep their names: a key
// without one is the key it always was (the ID below is the one of the
// plugin before access modes).
func TestAKeyWithoutAnAccessModeKeepsItsName(t *testing.T) {
	t.Parallel()
	require.Equal(t, "0fe1bbd5cd3b680467379a51e47602a90d155ff7e6d6ab46a5637b2a40482f11", testKey.ID())
}

func TestABrokenCacheFileIsAMissAndIsOverwritten(t *testing.T) {
	t.Parallel()
	valid := func(f *pluginFixture) string {
		c := &Credential{LeaseID: "abcdefghijklmnopqrstuvwxyz", Token: "old-SECRET", ObtainedAt: t0, ExpiresAt: t0.Add(time.Hour), RefreshAt: t0.Add(40 * time.Minute)}
		e := newEntry(testKey.ID(), testKey.Broker, c)
		return fmt.Sprintf(`{"version":%d,"key":%q,"broker":%q,"leaseId":%q,"token":%q,"obtainedAt":"2030-01-02T03:04:05Z","expiresAt":"2030-01-02T04:04:05Z","refreshAt":"2030-01-02T03:44:05Z"}`,
			e.Version, e.Key, e.Broker, e.LeaseID, e.Token)
	}
	for _, tc := range []struct {
		name    string
		content func(f *pluginFixture) string
		outcome Outcome
	}{
		{name: "a valid file is a hit (the control)", content: valid, outcome: OutcomeHit},
		{name: "a file cut short is a miss", content: func(f *pluginFixture) string { return valid(f)[:40] }, outcome: OutcomeCorrupt},
		{name: "an empty file is a miss", content: func(*pluginFixture) string { return "" }, outcome: OutcomeCorrupt},
		{name: "a file of another version is a miss", content: func(f *pluginFixture) string {
			return strings.Replace(valid(f), `"version":1`, `"version":2`, 1)
		}, outcome: OutcomeCorrupt},
		{name: "a file of another key is a miss", content: func(f *pluginFixture) string {
			return strings.Replace(valid(f), testKey.ID(), "0000", 1)
		}, outcome: OutcomeCorrupt},
		{name: "a file without a credential is a miss", content: func(f *pluginFixture) string {
			return strings.Replace(valid(f), `"token":"old-SECRET"`, `"token":""`, 1)
		}, outcome: OutcomeCorrupt},
		{name: "a file whose refresh point is after its expiry is a miss", content: func(f *pluginFixture) string {
			return strings.Replace(valid(f), `"refreshAt":"2030-01-02T03:44:05Z"`, `"refreshAt":"2030-01-02T05:00:00Z"`, 1)
		}, outcome: OutcomeCorrupt},
		{name: "a file over the size limit is a miss", content: func(*pluginFixture) string { return strings.Repeat(" ", maxEntryBytes+1) }, outcome: OutcomeCorrupt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPluginFixture(t)
			path := f.p.Cache.Path(testKey.ID())
			require.NoError(t, os.WriteFile(path, []byte(tc.content(f)), 0o600))
			c, outcome := f.get(t, kubectl1)
			require.Equal(t, tc.outcome, outcome)
			if tc.outcome == OutcomeHit {
				require.Equal(t, "old-SECRET", c.Token)
				return
			}
			require.Equal(t, "token-1-SECRET", c.Token)
			_, outcome = f.get(t, kubectl2)
			require.Equal(t, OutcomeHit, outcome, "the broken file was replaced")
		})
	}
}

func TestAFileInPlaceOfTheCacheFileIsAMissAndAWarning(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	require.NoError(t, os.Mkdir(f.p.Cache.Path(testKey.ID()), 0o700))
	c, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeCorrupt, outcome)
	require.NotEmpty(t, c.Token, "the credential is handed out although it could not be cached")
	require.Len(t, f.warned, 1)
	require.ErrorContains(t, f.warned[0], "was not cached")
}

func TestACacheOthersCouldReadIsRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		dirMode os.FileMode
		mode    os.FileMode
		err     string
	}{
		{name: "a world-readable cache file is refused, and the message says to delete it", dirMode: 0o700, mode: 0o644,
			err: "has mode 0644: group or others could read the credential in it; delete it (rm "},
		{name: "a group-readable cache file is refused", dirMode: 0o700, mode: 0o640, err: "has mode 0640"},
		{name: "a cache file others may only write is refused too", dirMode: 0o700, mode: 0o602, err: "has mode 0602"},
		{name: "a cache directory others may enter is refused, and the message says how to fix it", dirMode: 0o755, mode: 0o600,
			err: "has mode 0755, open to group or others; make it private with chmod 700 "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPluginFixture(t)
			f.get(t, kubectl1)
			path := f.p.Cache.Path(testKey.ID())
			require.NoError(t, os.Chmod(path, tc.mode))
			require.NoError(t, os.Chmod(f.p.Cache.Dir(), tc.dirMode))
			var err error
			if tc.dirMode != 0o700 {
				_, err = OpenCache(f.p.Cache.Dir())
			} else {
				_, _, err = f.p.Get(context.Background(), testKey, kubectl2, f.issuer.issue)
			}
			require.ErrorIs(t, err, ErrUnsafeCache)
			require.ErrorContains(t, err, tc.err)
			require.NotContains(t, err.Error(), "SECRET")
			require.NotContains(t, err.Error(), "\n")
			require.Equal(t, 1, f.issuer.issued(), "nothing is issued into an unsafe cache")
		})
	}
}

func TestACacheOfAnotherUserIsRefused(t *testing.T) {
	t.Parallel()
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a file to another user")
	}
	f := newPluginFixture(t)
	f.get(t, kubectl1)
	path := f.p.Cache.Path(testKey.ID())
	require.NoError(t, os.Chown(path, 4242, 4242))
	_, _, err := f.p.Get(context.Background(), testKey, kubectl2, f.issuer.issue)
	require.ErrorIs(t, err, ErrUnsafeCache)
	require.ErrorContains(t, err, "belongs to uid 4242")
	require.NoError(t, os.Chown(f.p.Cache.Dir(), 4242, 4242))
	_, err = OpenCache(f.p.Cache.Dir())
	require.ErrorContains(t, err, "the cache directory "+f.p.Cache.Dir()+" belongs to uid 4242")
}

func TestOpenCacheMakesAPrivateDirectory(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "xdg", "tokenbroker")
	c, err := OpenCache(dir)
	require.NoError(t, err)
	st, err := os.Stat(c.Dir())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	_, err = OpenCache("relative/tokenbroker")
	require.ErrorContains(t, err, "must be an absolute path")
	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = OpenCache(file)
	require.ErrorContains(t, err, "not a directory")
}

func TestParallelInvocationsMakeOneIssuance(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	const n = 20
	tokens := make([]string, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			c, _, err := f.p.Get(context.Background(), testKey, Parent{PID: 5000 + i}, f.issuer.issue)
			if err == nil {
				tokens[i] = c.Token
			}
		})
	}
	wg.Wait()
	require.Equal(t, 1, f.issuer.issued())
	for _, tok := range tokens {
		require.Equal(t, "token-1-SECRET", tok)
	}
}

func TestAnInvocationWaitsForTheLockOnlySoLong(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	unlock, err := f.p.Cache.lock(context.Background(), testKey.ID())
	require.NoError(t, err)
	defer unlock()
	f.p.Cache.lockTimeout = time.Nanosecond
	_, _, err = f.p.Get(context.Background(), testKey, kubectl1, f.issuer.issue)
	require.ErrorContains(t, err, "another tokenbroker credential has held the cache lock")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.p.Cache.lockTimeout = time.Hour
	_, _, err = f.p.Get(ctx, testKey, kubectl1, f.issuer.issue)
	require.ErrorIs(t, err, context.Canceled)
	require.Zero(t, f.issuer.issued())
}

func TestWithoutACacheEveryInvocationIssues(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	f.p.Cache = nil
	a, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeUncached, outcome)
	b, _ := f.get(t, kubectl1)
	require.NotEqual(t, a.Token, b.Token)
	require.Equal(t, a.RefreshAt, b.RefreshAt, "the expiration is still the refresh point")
}

func TestAnAnswerWithoutACredentialOrAlreadyExpiredIsAnError(t *testing.T) {
	t.Parallel()
	p := &Plugin{Clock: clocktesting.NewFakeClock(t0)}
	for _, c := range []*Credential{
		nil,
		{LeaseID: "x", ObtainedAt: t0, ExpiresAt: t0.Add(time.Hour)},
		{LeaseID: "x", Token: "t", ObtainedAt: t0, ExpiresAt: t0},
	} {
		_, _, err := p.Get(context.Background(), testKey, Parent{}, func(context.Context) (*Credential, error) { return c, nil })
		require.Error(t, err)
	}
}

func TestCredentialAndEntryNeverShowTheirSecrets(t *testing.T) {
	t.Parallel()
	c := &Credential{LeaseID: "l", Token: "tok-SECRET", ClientKeyData: "KEY-SECRET"}
	e := newEntry("id", "https://b", c)
	for _, s := range []string{c.String(), c.GoString(), fmt.Sprintf("%v %+v %#v", c, c, c), e.String(), fmt.Sprintf("%v %#v", e, e)} {
		require.NotContains(t, s, "SECRET")
	}
}

func TestPastTheRefreshPointABrokerThatIsAwayLeavesTheRestOfTheLife(t *testing.T) {
	t.Parallel()
	f := newPluginFixture(t)
	first, _ := f.get(t, kubectl1)
	down := connectionRefused
	f.issuer.fail.Store(&down)

	f.clock.SetTime(first.RefreshAt.Add(time.Second))
	stale, outcome := f.get(t, kubectl1)
	require.Equal(t, OutcomeStale, outcome)
	require.Equal(t, first.Token, stale.Token)
	require.Equal(t, f.clock.Now().Add(StaleRetry), stale.Status().Expiration, "client-go comes back in a minute")
	require.Len(t, f.warned, 1)
	require.ErrorContains(t, f.warned[0], "connection refused")
	require.ErrorContains(t, f.warned[0], "the cached one is used until it expires at 2030-01-02T04:04:05Z")

	f.clock.SetTime(first.ExpiresAt.Add(-10 * time.Second))
	stale, _ = f.get(t, kubectl2)
	require.Equal(t, first.ExpiresAt, stale.Status().Expiration, "never past the real expiry")

	f.clock.SetTime(first.ExpiresAt)
	_, _, err := f.p.Get(context.Background(), testKey, kubectl2, f.issuer.issue)
	require.ErrorIs(t, err, down, "an expired credential is never handed out")

	f.issuer.fail.Store(nil)
	_, outcome = f.get(t, kubectl2)
	require.Equal(t, OutcomeRefresh, outcome, "the broker is back")
}

func TestTwoWorkloadsNeverShareACacheEntry(t *testing.T) {
	t.Parallel()
	base := Key{Broker: "https://b", Identity: "spiffe://oc.example/cluster/west", Namespace: "argo", ServiceAccount: "runner"}
	a, b := base, base
	a.Workload = "https://west system:serviceaccount:ci:deployer"
	b.Workload = "https://west system:serviceaccount:ci:tester"
	require.NotEqual(t, a.ID(), b.ID())
	require.NotEqual(t, base.ID(), a.ID(), "a workload's entry is not the peer's")
	require.Equal(t, a.ID(), a.ID())
}

func TestWorkloadOfNamesTheTokensIssuerAndServiceAccount(t *testing.T) {
	t.Parallel()
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	token := enc(`{"alg":"ES256"}`) + "." + enc(`{"iss":"https://west","sub":"system:serviceaccount:ci:deployer"}`) + "." + enc("sig")
	w, err := WorkloadOf(token)
	require.NoError(t, err)
	require.Equal(t, "https://west system:serviceaccount:ci:deployer", w)
	_, err = WorkloadOf("not-a-token")
	require.Error(t, err)
	_, err = WorkloadOf(enc(`{"alg":"ES256"}`) + "." + enc(`{"iss":"https://west","sub":"alice"}`) + "." + enc("sig"))
	require.Error(t, err, "a token of a person is not a workload token")
}

// connectionRefused is what the broker's client returns when nothing
// listens: a *url.Error around a dial *net.OpError.
var connectionRefused error = fmt.Errorf("broker https://east.example.com:8443: %w", &url.Error{Op: "Post", URL: "https://east.example.com:8443/v1/kubeconfigs",
	Err: &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}})

func TestACachedCredentialStandsInOnlyForABrokerThatIsAway(t *testing.T) {
	t.Parallel()
	problem := func(status int) error {
		return fmt.Errorf("broker https://east.example.com:8443: %w", &client.ProblemError{Status: status})
	}
	tests := []struct {
		name string
		err  error
		// stale: the cached credential is handed out; dropped: the entry
		// is gone afterwards.
		stale, dropped bool
	}{
		{name: "a refused connection is a broker that is away", err: connectionRefused, stale: true},
		{name: "a timeout is a broker that is away", err: fmt.Errorf("broker: %w", context.DeadlineExceeded), stale: true},
		{name: "a connection cut off in the answer is a broker that is away", err: fmt.Errorf("read the answer: %w", io.ErrUnexpectedEOF), stale: true},
		{name: "a 503 is a broker that is away", err: problem(http.StatusServiceUnavailable), stale: true},
		{name: "a 500 is a broker that is away", err: problem(http.StatusInternalServerError), stale: true},
		{name: "a 429 is a broker that is busy", err: problem(http.StatusTooManyRequests), stale: true},
		{name: "a 401 drops the entry: the broker no longer accepts this identity", err: problem(http.StatusUnauthorized), dropped: true},
		{name: "a 403 drops the entry: the policy no longer grants the request", err: problem(http.StatusForbidden), dropped: true},
		{name: "a 422 is an answer, not an absence", err: problem(http.StatusUnprocessableEntity)},
		{name: "a 400 is an answer, not an absence", err: problem(http.StatusBadRequest)},
		{name: "a local failure such as an unreadable identity is no absence of the broker", err: errors.New("read the identity: permission denied")},
		{name: "a broker that fails TLS verification is not taken for one that is away", err: &url.Error{Op: "Post", URL: "https://b", Err: x509.UnknownAuthorityError{}}},
		{name: "a client certificate the broker refuses in the TLS handshake drops the entry", err: refusedInHandshake(t), dropped: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPluginFixture(t)
			first, _ := f.get(t, kubectl1)
			f.issuer.fail.Store(&tc.err)
			f.clock.SetTime(first.RefreshAt.Add(time.Second))
			c, outcome, err := f.p.Get(context.Background(), testKey, kubectl2, f.issuer.issue)
			if tc.stale {
				require.NoError(t, err)
				require.Equal(t, OutcomeStale, outcome)
				require.Equal(t, first.Token, c.Token)
				return
			}
			require.ErrorIs(t, err, tc.err)
			require.Nil(t, c, "the cached credential is not handed out")
			_, statErr := os.Stat(f.p.Cache.Path(testKey.ID()))
			if tc.dropped {
				require.ErrorIs(t, statErr, os.ErrNotExist, "the entry is dropped")
				// Even a broker that is away later gets no stale credential.
				f.issuer.fail.Store(&connectionRefused)
				_, _, err = f.p.Get(context.Background(), testKey, kubectl2, f.issuer.issue)
				require.ErrorIs(t, err, connectionRefused)
			} else {
				require.NoError(t, statErr, "an answer that is no refusal keeps the entry")
			}
		})
	}
}

func TestAnyEntryOfTheRequestIsDroppedWhenTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	// A corrupt entry and a refused one are gone after a 403 too, so that
	// nothing the broker issued before its refusal is left behind.
	f := newPluginFixture(t)
	path := f.p.Cache.Path(testKey.ID())
	require.NoError(t, os.WriteFile(path, []byte("{"), 0o600))
	forbidden := error(&client.ProblemError{Status: http.StatusForbidden})
	f.issuer.fail.Store(&forbidden)
	_, outcome, err := f.p.Get(context.Background(), testKey, kubectl1, f.issuer.issue)
	require.ErrorIs(t, err, forbidden)
	require.Equal(t, OutcomeCorrupt, outcome)
	_, err = os.Stat(path)
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestACacheDirectoryAnotherUserCouldReplaceIsRefused(t *testing.T) {
	t.Parallel()
	t.Run("a cache directory that is a symbolic link is refused", func(t *testing.T) {
		t.Parallel()
		base := t.TempDir()
		real := filepath.Join(base, "real")
		require.NoError(t, os.Mkdir(real, 0o700))
		link := filepath.Join(base, "tokenbroker")
		require.NoError(t, os.Symlink(real, link))
		_, err := OpenCache(link)
		require.ErrorIs(t, err, ErrUnsafeCache)
		require.ErrorContains(t, err, "is a symbolic link")
	})
	t.Run("a dangling symbolic link is not followed to create a directory", func(t *testing.T) {
		t.Parallel()
		base := t.TempDir()
		target := filepath.Join(base, "elsewhere")
		link := filepath.Join(base, "tokenbroker")
		require.NoError(t, os.Symlink(target, link))
		_, err := OpenCache(link)
		require.ErrorIs(t, err, ErrUnsafeCache)
		_, err = os.Lstat(target)
		require.ErrorIs(t, err, os.ErrNotExist)
	})
	t.Run("a parent everyone may write is refused", func(t *testing.T) {
		t.Parallel()
		parent := filepath.Join(t.TempDir(), "shared")
		require.NoError(t, os.Mkdir(parent, 0o700))
		require.NoError(t, os.Chmod(parent, 0o777))
		_, err := OpenCache(filepath.Join(parent, "tokenbroker"))
		require.ErrorIs(t, err, ErrUnsafeCache)
		require.ErrorContains(t, err, "anyone could replace the cache directory")
	})
	t.Run("a parent everyone may write with the sticky bit, like /tmp, is accepted", func(t *testing.T) {
		t.Parallel()
		parent := filepath.Join(t.TempDir(), "tmp")
		require.NoError(t, os.Mkdir(parent, 0o700))
		require.NoError(t, os.Chmod(parent, 0o777|os.ModeSticky))
		_, err := OpenCache(filepath.Join(parent, "tokenbroker"))
		require.NoError(t, err)
	})
	groupWritable := func(t *testing.T) (string, int) {
		t.Helper()
		parent := filepath.Join(t.TempDir(), "cache")
		require.NoError(t, os.Mkdir(parent, 0o700))
		require.NoError(t, os.Chmod(parent, 0o775))
		st, err := os.Stat(parent)
		require.NoError(t, err)
		gid, ok := fileGroup(st)
		require.True(t, ok)
		return parent, gid
	}
	t.Run("a parent of yours its group may write is accepted when the group is your private group", func(t *testing.T) {
		t.Parallel()
		parent, gid := groupWritable(t)
		_, err := openCache(filepath.Join(parent, "tokenbroker"), os.Geteuid(), func(g int) bool { return g == gid })
		require.NoError(t, err)
	})
	t.Run("a parent of yours its group may write is refused when the group is shared", func(t *testing.T) {
		t.Parallel()
		parent, _ := groupWritable(t)
		_, err := openCache(filepath.Join(parent, "tokenbroker"), os.Geteuid(), func(int) bool { return false })
		require.ErrorIs(t, err, ErrUnsafeCache)
		require.ErrorContains(t, err, "not your own private group")
	})
	t.Run("a root-owned parent its group may write is refused even with your private group", func(t *testing.T) {
		t.Parallel()
		if os.Geteuid() != 0 {
			t.Skip("needs root to make a root-owned directory")
		}
		parent, gid := groupWritable(t)
		// The cache of user 4242, whose private group would be the
		// directory's: the directory is still root's to share.
		_, err := openCache(filepath.Join(parent, "tokenbroker"), 4242, func(g int) bool { return g == gid })
		require.ErrorIs(t, err, ErrUnsafeCache)
		require.ErrorContains(t, err, "not your own private group")
	})
	t.Run("a group-writable parent with the sticky bit is accepted whatever its group", func(t *testing.T) {
		t.Parallel()
		parent, _ := groupWritable(t)
		require.NoError(t, os.Chmod(parent, 0o775|os.ModeSticky))
		_, err := openCache(filepath.Join(parent, "tokenbroker"), os.Geteuid(), func(int) bool { return false })
		require.NoError(t, err)
	})
	t.Run("a parent of yours whose group is another, shared one is refused", func(t *testing.T) {
		t.Parallel()
		if os.Geteuid() != 0 {
			t.Skip("needs root to give a directory to another group")
		}
		parent, _ := groupWritable(t)
		require.NoError(t, os.Chown(parent, os.Geteuid(), 4243))
		_, err := OpenCache(filepath.Join(parent, "tokenbroker"))
		require.ErrorIs(t, err, ErrUnsafeCache)
	})
	t.Run("a parent of another user is refused", func(t *testing.T) {
		t.Parallel()
		if os.Geteuid() != 0 {
			t.Skip("needs root to give a directory to another user")
		}
		parent := filepath.Join(t.TempDir(), "theirs")
		require.NoError(t, os.Mkdir(parent, 0o755))
		require.NoError(t, os.Chown(parent, 4242, 4242))
		_, err := OpenCache(filepath.Join(parent, "tokenbroker"))
		require.ErrorIs(t, err, ErrUnsafeCache)
		require.ErrorContains(t, err, "belongs to uid 4242")
	})
}

// TestABrokerThatSaysRetryInAMomentIsAskedAgain: a 503 or 429 with a short
// Retry-After (a new Pod's token before its cluster's agent reported the
// Pod) is asked again after it, at most three times; a refusal is not, nor
// a long Retry-After.
func TestABrokerThatSaysRetryInAMomentIsAskedAgain(t *testing.T) {
	t.Parallel()
	notYet := &client.ProblemError{Status: http.StatusServiceUnavailable, RetryAfter: time.Second}
	for _, tc := range []struct {
		name      string
		answers   []error
		wantCalls int
		wantWaits []time.Duration
		wantErr   bool
	}{
		{"503 then a credential", []error{notYet, nil}, 2, []time.Duration{time.Second}, false},
		{"429 then a credential", []error{&client.ProblemError{Status: http.StatusTooManyRequests, RetryAfter: 2 * time.Second}, nil}, 2, []time.Duration{2 * time.Second}, false},
		{"at most three retries", []error{notYet, notYet, notYet, notYet, nil}, 4, []time.Duration{time.Second, time.Second, time.Second}, true},
		{"a 401 is an answer", []error{&client.ProblemError{Status: http.StatusUnauthorized}, nil}, 1, nil, true},
		{"a long Retry-After is not waited for", []error{&client.ProblemError{Status: http.StatusServiceUnavailable, RetryAfter: time.Minute}, nil}, 1, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newPluginFixture(t)
			var waits []time.Duration
			f.p.Wait = func(_ context.Context, d time.Duration) error { waits = append(waits, d); return nil }
			calls := 0
			issue := func(ctx context.Context) (*Credential, error) {
				err := tc.answers[calls]
				calls++
				if err != nil {
					return nil, err
				}
				return f.issuer.issue(ctx)
			}
			_, _, err := f.p.Get(context.Background(), testKey, kubectl1, issue)
			require.Equal(t, tc.wantErr, err != nil, "%v", err)
			require.Equal(t, tc.wantCalls, calls)
			require.Equal(t, tc.wantWaits, waits)
		})
	}
}
