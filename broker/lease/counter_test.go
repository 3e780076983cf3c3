package lease

import (
	"context"
	"encoding/base64"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	k8stesting "k8s.io/client-go/testing"

	metadatafake "k8s.io/client-go/metadata/fake"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestTheCounterKeepsWatchingANamespaceThatStillHoldsLeasesToRevoke: with
// per-namespace RBAC the counter is the GC's only sight of a namespace that
// left its selector grant; dropping its watch would forget the leases the GC
// is to revoke there.
func TestTheCounterKeepsWatchingANamespaceThatStillHoldsLeasesToRevoke(t *testing.T) {
	t.Parallel()
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	secret := func(ns, name string, marked bool) *metav1.PartialObjectMetadata {
		m := secretMeta(ns, name, "west", exp)
		m.TypeMeta = metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"}
		m.Labels[objects.LabelManagedBy] = objects.ManagedByValue
		m.Annotations[objects.AnnotationGrant] = "oil"
		if marked {
			m.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
		}
		return m
	}
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("Secret"), &metav1.PartialObjectMetadata{})
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("SecretList"), &metav1.PartialObjectMetadataList{})
	client := metadatafake.NewSimpleMetadataClient(scheme,
		secret("oil-dev", "tokenbroker-lease-a", true), secret("oil-old", "tokenbroker-lease-b", false), secret("argo", "tokenbroker-lease-c", false))
	// oil-dev's watch is one the test holds, so that the deletion below
	// reaches the counter however late its reflector starts watching (the
	// fake's own watch loses what happens between its list and its watch).
	var watchMu sync.Mutex
	var oilDev *watch.RaceFreeFakeWatcher
	client.PrependWatchReactor("secrets", func(a k8stesting.Action) (bool, watch.Interface, error) {
		if a.GetNamespace() != "oil-dev" {
			return false, nil, nil
		}
		watchMu.Lock()
		defer watchMu.Unlock()
		oilDev = watch.NewRaceFreeFake()
		return true, oilDev, nil
	})
	lc := NewCounter(client, clocktesting.NewFakePassiveClock(exp.Add(-time.Hour)), zap.NewNop())
	t.Cleanup(lc.stopWatches)
	rules := func(namespaces ...string) *Rules {
		r := &Rules{Peers: map[string]PeerRule{"west": {Namespaces: map[string]struct{}{}}}}
		for _, ns := range namespaces {
			r.Peers["west"].Namespaces[ns] = struct{}{}
		}
		return r
	}
	var mu sync.Mutex
	current := rules("argo", "oil-dev", "oil-old")
	lc.SetRules(func() *Rules { mu.Lock(); defer mu.Unlock(); return current })
	watching := func() []string {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		return slices.Sorted(maps.Keys(lc.watches))
	}
	lc.watch([]string{"argo", "oil-dev", "oil-old"})
	require.Eventually(t, func() bool { own, _ := lc.Live("west"); return lc.Synced() && own == 3 }, 30*time.Second, time.Millisecond)

	// oil-dev and oil-old left the grant: the policy no longer grants
	// them, so their leases stop counting; the GC is still to revoke them.
	mu.Lock()
	current = rules("argo")
	mu.Unlock()
	lc.Sweep()
	own, _ := lc.Live("west")
	require.Equal(t, 1, own, "leases in namespaces the policy no longer grants do not count")
	lc.watch([]string{"argo"})
	require.Equal(t, []string{"argo", "oil-dev"}, watching(), "the namespace with a marked lease is still watched")
	require.Contains(t, lc.LeaseRefs(), Ref{Namespace: "oil-dev", Peer: "west", Grant: "oil", Mark: "0s", Marked: true})

	require.NoError(t, client.Resource(SecretsGVR).Namespace("oil-dev").Delete(context.Background(), "tokenbroker-lease-a", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { watchMu.Lock(); defer watchMu.Unlock(); return oilDev != nil }, 30*time.Second, time.Millisecond)
	watchMu.Lock()
	oilDev.Delete(secret("oil-dev", "tokenbroker-lease-a", true))
	watchMu.Unlock()
	require.Eventually(t, func() bool {
		return !slices.ContainsFunc(lc.LeaseRefs(), func(l Ref) bool { return l.Namespace == "oil-dev" })
	}, 30*time.Second, time.Millisecond)
	lc.watch([]string{"argo"})
	require.Equal(t, []string{"argo"}, watching(), "once revoked, the namespace is dropped")
}

func TestLeaseContinueTokensRoundTrip(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cur  Cursor
	}{
		{"A namespace's beginning has no API token.", Cursor{Namespace: "argo"}},
		{"The API server's token is kept as it is, in either base64 alphabet.", Cursor{Namespace: "flux-system", APIContinue: "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTIzfQ=="}},
		{"A URL-safe API token survives too.", Cursor{Namespace: "a", APIContinue: "ab-_cd+/"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			token := EncodeContinue(tc.cur)
			require.NotContains(t, token, tc.cur.Namespace, "opaque: the namespace is not readable in it")
			got, err := decodeLeaseContinue(token)
			require.NoError(t, err)
			require.Equal(t, tc.cur, got)
		})
	}
}

func TestLeaseContinueTokensThatAreNotOursAreRefused(t *testing.T) {
	t.Parallel()
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	for name, token := range map[string]string{
		"An empty token.":                          "",
		"Not base64url.":                           "a b c",
		"Padded base64 (not the canonical form).":  base64.URLEncoding.EncodeToString([]byte("l1\nargo\n")),
		"Another version.":                         enc("l2\nargo\n"),
		"Too few parts.":                           enc("l1\nargo"),
		"Too many parts.":                          enc("l1\nargo\nx\ny"),
		"A namespace that is no DNS label.":        enc("l1\nArgo\n"),
		"A path as the namespace.":                 enc("l1\n../kube-system\n"),
		"An empty namespace.":                      enc("l1\n\n"),
		"An API token with other characters.":      enc("l1\nargo\n{\"rv\":1}"),
		"An API token with a NUL.":                 enc("l1\nargo\nab\x00"),
		"A token over the size bound.":             enc("l1\nargo\n" + strings.Repeat("a", MaxLeaseContinueBytes)),
		"Non-canonical trailing bits of base64url": enc("l1\nargo\nab")[:len(enc("l1\nargo\nab"))-1] + "B",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := decodeLeaseContinue(token)
			require.ErrorIs(t, err, errBadContinue)
		})
	}
}

func FuzzDecodeLeaseContinue(f *testing.F) {
	f.Add(EncodeContinue(Cursor{Namespace: "argo"}))
	f.Add(EncodeContinue(Cursor{Namespace: "argo", APIContinue: "eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ=="}))
	f.Add("")
	f.Add("bDEKYXJnbwo")
	f.Fuzz(func(t *testing.T, token string) {
		cur, err := decodeLeaseContinue(token)
		if err != nil {
			require.ErrorIs(t, err, errBadContinue)
			return
		}
		// Whatever is accepted is canonical and within bounds.
		require.Equal(t, token, EncodeContinue(cur))
		require.LessOrEqual(t, len(token), MaxLeaseContinueBytes)
		require.NotContains(t, cur.Namespace, "/")
		require.NotContains(t, cur.APIContinue, "\n")
	})
}

func TestTheLeaseQuotaRefusesAPeerAtItsMaximumUntilAPlaceIsFree(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakePassiveClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := NewCounter(nil, clk, zap.NewNop())
	first, full := lc.Reserve("west", 2, 10)
	require.Empty(t, full)
	second, full := lc.Reserve("west", 2, 10)
	require.Empty(t, full, "two places for two requests in flight")
	_, full = lc.Reserve("west", 2, 10)
	require.Equal(t, QuotaPeer, full, "a third concurrent request would exceed the quota")

	exp := clk.Now().Add(time.Hour)
	lc.Observe(secretMeta("argo", "tokenbroker-lease-a", "west", exp)) // the informer sees the first lease before its request ends
	first.Commit("argo", "tokenbroker-lease-a", exp)
	first.Release() // no-op after commit
	own, total := lc.Live("west")
	require.Equal(t, 2, own, "one lease (counted once) and one place")
	require.Equal(t, 2, total)
	_, full = lc.Reserve("south", 5, 2)
	require.Equal(t, QuotaTotal, full, "the global quota counts every peer")

	second.Release() // the second request created nothing
	own, _ = lc.Live("west")
	require.Equal(t, 1, own)
	lc.remove(secretMeta("argo", "tokenbroker-lease-a", "west", exp)) // revoked
	own, total = lc.Live("west")
	require.Zero(t, own)
	require.Zero(t, total)
}

// A lease stops counting at its recorded expiry, whether or not GC ever
// deletes its Secret (one left in a namespace the policy no longer
// grants is never collected).
func TestAnExpiredLeaseStopsCountingEvenIfNobodyDeletesIt(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakePassiveClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := NewCounter(nil, clk, zap.NewNop())
	lc.Observe(secretMeta("old", "tokenbroker-lease-a", "west", clk.Now().Add(time.Minute)))
	lc.Observe(secretMeta("argo", "tokenbroker-lease-b", "west", clk.Now().Add(time.Hour)))
	lc.Observe(secretMeta("argo", "tokenbroker-lease-c", "west", clk.Now().Add(-time.Minute)))
	own, total := lc.Live("west")
	require.Equal(t, 2, own, "one already expired when seen")
	require.Equal(t, 2, total)

	clk.SetTime(clk.Now().Add(2 * time.Minute))
	lc.Sweep()
	own, _ = lc.Live("west")
	require.Equal(t, 1, own)
	lc.remove(secretMeta("old", "tokenbroker-lease-a", "west", time.Time{}))
	own, total = lc.Live("west")
	require.Equal(t, 1, own, "deleting an expired lease does not count it twice")
	require.Equal(t, 1, total)
}

func TestTheCounterIsItsReflectorsStore(t *testing.T) {
	t.Parallel()
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	lc := NewCounter(nil, clocktesting.NewFakePassiveClock(exp.Add(-time.Hour)), zap.NewNop())
	argo := &counterStore{lc: lc, ns: "argo", w: &nsWatch{}}
	flux := &counterStore{lc: lc, ns: "flux", w: &nsWatch{}}
	require.NoError(t, argo.Replace([]any{secretMeta("argo", "a", "west", exp), secretMeta("argo", "b", "west", exp)}, "1"))
	require.NoError(t, flux.Replace([]any{secretMeta("flux", "c", "west", exp)}, "1"))
	require.True(t, argo.w.synced.Load())
	own, _ := lc.Live("west")
	require.Equal(t, 3, own)

	// A relist of argo forgets what went meanwhile, and only in argo.
	require.NoError(t, argo.Replace([]any{secretMeta("argo", "b", "west", exp)}, "2"))
	own, _ = lc.Live("west")
	require.Equal(t, 2, own)
	require.NoError(t, argo.Delete(secretMeta("argo", "b", "west", exp)))
	require.NoError(t, flux.Update(secretMeta("flux", "c", "east", exp)))
	own, _ = lc.Live("west")
	require.Zero(t, own)
	own, _ = lc.Live("east")
	require.Equal(t, 1, own, "an update replaces what the counter knew")
}

func secretMeta(ns, name, peer string, expires time.Time) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{
		Namespace: ns, Name: name, Labels: map[string]string{objects.LabelPeer: peer, objects.LabelKind: objects.LeaseKind},
		Annotations: map[string]string{objects.AnnotationExpiresAt: expires.UTC().Format(time.RFC3339)},
	}}
}

func TestTheCounterSweepsOnlyWhatExpired(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Now())
	lc := NewCounter(nil, clk, zap.NewNop())
	for i := range 1000 {
		lc.Observe(secretMeta("argo", "l"+string(rune('a'+i%26))+time.Duration(i).String(), "west", clk.Now().Add(time.Duration(i+1)*time.Second)))
	}
	clk.Step(10 * time.Second)
	require.Len(t, lc.Expired(100), 10)
	require.Len(t, lc.expiring, 990, "the heap gave up the ten that expired, no more")
	own, _ := lc.Live("west")
	require.Equal(t, 990, own)
}

// forgedMeta is the metadata of a Secret of the lease type that anyone who
// may create Secrets in ns can write.
func forgedMeta(ns, name, peer, identity string, created, expires time.Time) *metav1.PartialObjectMetadata {
	m := secretMeta(ns, name, peer, expires)
	m.UID = types.UID("uid-" + ns + "-" + name)
	m.CreationTimestamp = metav1.NewTime(created)
	m.Labels[objects.LabelManagedBy] = objects.ManagedByValue
	m.Annotations[objects.AnnotationIdentity] = identity
	return m
}

// westRules grant west (its identity) the argo namespace, with leases of at
// most a day and the slack of the pool.
func westRules() *Rules {
	return &Rules{MaxAge: 24*time.Hour + AgeSlack, Peers: map[string]PeerRule{
		"west": {Identity: "spiffe://oc.example/cluster/west", Namespaces: map[string]struct{}{"argo": {}}},
	}}
}

// A forged Secret of the lease type with large annotations costs the
// counter no more than a small one: values longer than the broker ever
// writes are not kept, and such a Secret verifies as nothing.
func TestTheCounterKeepsNothingOfOversizedLeaseAnnotations(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := NewCounter(nil, clk, zap.NewNop())
	lc.SetRules(westRules)
	now := clk.Now()
	m := forgedMeta("argo", "tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa", "west", "spiffe://oc.example/cluster/west/"+strings.Repeat("x", 200_000), now, now.Add(time.Hour))
	m.Annotations[objects.AnnotationGrant] = strings.Repeat("g", 50_000)
	m.Annotations[objects.AnnotationRevokeOnUnmatch] = strings.Repeat("1", 50_000)
	lc.Observe(m)
	lc.mu.Lock()
	c := lc.byKey["argo/tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa"]
	lc.mu.Unlock()
	require.NotNil(t, c)
	require.Empty(t, c.identity)
	require.Empty(t, c.grant)
	require.Empty(t, c.mark)
	own, total := lc.Live("west")
	require.Zero(t, own, "an identity the broker never writes verifies as nothing")
	require.Zero(t, total)
}

// A forged lease marked for revocation on unmatch, with an expiry years
// away, keeps its namespace watched only until creation plus the longest
// TTL and its slack, as it counts.
func TestAForgedMarkAgesOutWithTheCappedExpiry(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := NewCounter(nil, clk, zap.NewNop())
	lc.SetRules(westRules)
	now := clk.Now()
	m := forgedMeta("argo", "tokenbroker-lease-aaaaaaaaaaaaaaaaaaaaaaaaaa", "west", "spiffe://oc.example/cluster/west", now, now.AddDate(10, 0, 0))
	m.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	lc.Observe(m)
	marked := func() bool {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		return lc.markedNamespacesLocked()["argo"]
	}
	require.True(t, marked())
	clk.Step(24*time.Hour + 10*time.Minute)
	require.False(t, marked(), "past creation + ttl.max + slack")
}
