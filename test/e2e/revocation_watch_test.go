package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestAWatchOpenedBeforeARevocationOutlivesItUntilTheAPIServerEndsIt shows
// on a real API server what docs/security.md ("Revocation and open
// watches") says: the API server authenticates a request when it starts,
// so a watch opened with a brokered token before its lease is revoked goes
// on delivering events after new requests with the token are refused, and
// ends only when the API server ends it, after --min-request-timeout to
// twice that. The harness runs with 30 s, so the watch must end within
// 60 s of being opened; with the default 1800 s it would be 30 to 60
// minutes.
func TestAWatchOpenedBeforeARevocationOutlivesItUntilTheAPIServerEndsIt(t *testing.T) {
	t.Parallel()
	const minRequestTimeout = 30 * time.Second
	c := testcluster.Start(t, testcluster.WithMinRequestTimeout(minRequestTimeout))
	setUpTarget(t, c)
	ctx := context.Background()
	// runner may also watch ConfigMaps in argo (setUpTarget grants get
	// and list).
	_, err := c.Client.RbacV1().Roles("argo").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "configmap-watcher"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"watch"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "runner-watch"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "configmap-watcher"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "runner", Namespace: "argo"}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	e := startBroker(t, c)

	status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`)
	require.Equal(t, 201, status, body)
	var lease apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &lease))
	brokered, err := kubernetes.NewForConfig(&rest.Config{
		Host:            c.URL,
		BearerToken:     lease.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData},
	})
	require.NoError(t, err)

	// The watch, opened with the brokered token; events are recorded with
	// the time they arrived.
	w, err := brokered.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	opened := time.Now()
	defer w.Stop()
	var (
		mu       sync.Mutex
		received = map[string]time.Time{}
	)
	ended := make(chan time.Time, 1)
	go func() {
		for ev := range w.ResultChan() {
			if ev.Type == watch.Added {
				if cm, ok := ev.Object.(*corev1.ConfigMap); ok {
					mu.Lock()
					received[cm.Name] = time.Now()
					mu.Unlock()
				}
			}
		}
		ended <- time.Now()
	}()
	seen := func(name string) bool {
		mu.Lock()
		defer mu.Unlock()
		_, ok := received[name]
		return ok
	}
	n := 0
	create := func() string {
		n++
		name := fmt.Sprintf("event-%d", n)
		_, err := c.Client.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		require.NoError(t, err)
		return name
	}
	before := create()
	require.Eventually(t, func() bool { return seen(before) }, 5*time.Second, 20*time.Millisecond, "the watch delivers events before the revocation")

	run(t, e.bin, "leases", "revoke", "-n", "argo", lease.LeaseID, "--kubeconfig", c.KubeconfigPath)
	revoked := time.Now()

	// New requests with the token are refused once the API server's token
	// cache lets go (about 10 s).
	refused := whenRefused(t, func() error {
		_, err := brokered.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{})
		return err
	})
	_, err = brokered.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsUnauthorized(err), "a new watch is refused too: %v", err)

	// The open watch still delivers: an event made after the refusal
	// arrives on it.
	after := create()
	require.Eventually(t, func() bool { return seen(after) }, 5*time.Second, 20*time.Millisecond,
		"the watch opened before the revocation delivers an event made after new requests were refused")
	delivered := 1
	var end time.Time
	deadline := time.After(2*minRequestTimeout + 15*time.Second - time.Since(opened))
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
wait:
	for {
		select {
		case end = <-ended:
			break wait
		case <-tick.C:
			name := create()
			require.Eventually(t, func() bool { return seen(name) || len(ended) > 0 }, 5*time.Second, 20*time.Millisecond,
				"until it ends, the watch delivers every event")
			if seen(name) {
				delivered++
			}
		case <-deadline:
			t.Fatalf("the watch was still open %s after it was opened, beyond twice --min-request-timeout", time.Since(opened).Round(time.Second))
		}
	}
	life, afterRevoke, afterRefusal := end.Sub(opened), end.Sub(revoked), end.Sub(refused)
	t.Logf("new requests refused %s after the revocation; the open watch delivered %d events after that and ended %s after the revocation (%s after the refusal, open %s in all, --min-request-timeout %s)",
		refused.Sub(revoked).Round(100*time.Millisecond), delivered, afterRevoke.Round(100*time.Millisecond),
		afterRefusal.Round(100*time.Millisecond), life.Round(100*time.Millisecond), minRequestTimeout)
	require.GreaterOrEqual(t, life, minRequestTimeout-time.Second, "the API server ends a watch no earlier than --min-request-timeout")
	require.LessOrEqual(t, life, 2*minRequestTimeout+5*time.Second, "and no later than twice it")
	require.Greater(t, afterRefusal, time.Duration(0), "the watch outlived the refusal of new requests")

	// Re-establishing it, as an informer would, is refused.
	_, err = brokered.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsUnauthorized(err), "the informer's re-watch is refused: %v", err)
}

// whenRefused polls request until the API server answers it 401 (a
// revoked credential, once its token cache lets go: about 10 s) and
// returns when that was; it fails the test after 20 s.
func whenRefused(t *testing.T, request func() error) time.Time {
	t.Helper()
	var refused time.Time
	require.Eventually(t, func() bool {
		if apierrors.IsUnauthorized(request()) {
			refused = time.Now()
			return true
		}
		return false
	}, 20*time.Second, 200*time.Millisecond, "a new request with the revoked credential is refused")
	return refused
}
