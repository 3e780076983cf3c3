package vaultengine

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The lift must reach the client the plugin actually uses: with the
// lifted client pointed at another server, the plugin's TokenRequest lands
// there and not at the configured kubernetes_host.
func TestLiftingTheLimiterReplacesTheClientThePluginUses(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var paths []string
	record := func(paths *[]string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			*paths = append(*paths, r.Method+" "+r.URL.Path)
			mu.Unlock()
			http.Error(w, "no", http.StatusServiceUnavailable)
		}
	}
	var configured []string
	host := httptest.NewServer(record(&configured))
	defer host.Close()
	lifted := httptest.NewServer(record(&paths))
	defer lifted.Close()

	e, err := New(t.Context(), Config{Host: host.URL, Token: "not-a-token", Namespace: "bench", Mode: Unrevocable,
		ServiceAccount: "runner", TTL: 10 * time.Minute})
	require.NoError(t, err)
	require.NoError(t, setClient(e.backend, restConfigFor(lifted.URL)))

	_, err = e.Issue(t.Context())
	require.Error(t, err, "the recording server refuses everything")
	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, paths, "POST /api/v1/namespaces/bench/serviceaccounts/runner/token")
	require.Empty(t, configured)
}

// Each mode, as shipped and lifted, against a real kube-apiserver: the
// credential authenticates; the revocable one is refused after revoke and
// its ServiceAccount and RoleBinding are gone; the unrevocable one's
// revoke deletes nothing. Polls with deadlines, times nothing.
func TestEachModeIssuesAWorkingCredentialAndOnlyTheRevocableOneIsRevoked(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a real kube-apiserver; skipped with -short")
	}
	t.Parallel()
	c := testcluster.Start(t)
	ctx := t.Context()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().ServiceAccounts("bench").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().Roles("bench").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "bench-view"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	token, err := Grant(ctx, c.Client, "vault", time.Hour)
	require.NoError(t, err)

	for _, tc := range []struct {
		name string
		mode Mode
		lift Limit
	}{
		{"unrevocable as shipped", Unrevocable, Limit{}},
		{"unrevocable with the limiter lifted", Unrevocable, Limit{QPS: 2000, Burst: 4000}},
		{"revocable as shipped", Revocable, Limit{}},
		{"revocable with the limiter lifted", Revocable, Limit{QPS: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, err := New(ctx, Config{Host: c.URL, CAData: c.CAData, Token: token, Namespace: "bench", Mode: tc.mode,
				ServiceAccount: "runner", Role: "bench-view", TTL: 10 * time.Minute, LiftLimiter: tc.lift})
			require.NoError(t, err)
			cred, err := e.Issue(ctx)
			require.NoError(t, err)
			require.Equal(t, "bench", cred.Namespace)
			probe, err := NewProbe(c.URL, c.CAData, cred.Token)
			require.NoError(t, err)
			ok, err := probe.Accepted(ctx)
			require.NoError(t, err)
			require.True(t, ok, "a fresh credential authenticates")

			if tc.mode == Unrevocable {
				require.Equal(t, "runner", cred.ServiceAccount)
				require.NoError(t, e.Revoke(ctx, cred))
				_, err := c.Client.CoreV1().ServiceAccounts("bench").Get(ctx, "runner", metav1.GetOptions{})
				require.NoError(t, err, "revoking an unrevocable lease deletes nothing")
				ok, err := probe.Accepted(ctx)
				require.NoError(t, err)
				require.True(t, ok)
				return
			}

			require.True(t, strings.HasPrefix(cred.ServiceAccount, "v-bench-"), cred.ServiceAccount)
			_, err = c.Client.CoreV1().ServiceAccounts("bench").Get(ctx, cred.ServiceAccount, metav1.GetOptions{})
			require.NoError(t, err, "the credential's own ServiceAccount")
			_, err = c.Client.RbacV1().RoleBindings("bench").Get(ctx, cred.ServiceAccount, metav1.GetOptions{})
			require.NoError(t, err, "the credential's own RoleBinding")

			revoked := time.Now()
			require.NoError(t, e.Revoke(ctx, cred))
			_, err = c.Client.CoreV1().ServiceAccounts("bench").Get(ctx, cred.ServiceAccount, metav1.GetOptions{})
			require.True(t, apierrors.IsNotFound(err), "ServiceAccount deleted: %v", err)
			_, err = c.Client.RbacV1().RoleBindings("bench").Get(ctx, cred.ServiceAccount, metav1.GetOptions{})
			require.True(t, apierrors.IsNotFound(err), "RoleBinding deleted: %v", err)
			// The API server caches a token's authentication for 10 s.
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			d, refused, err := probe.WaitRefused(wctx, revoked, 100*time.Millisecond)
			require.NoError(t, err)
			require.True(t, refused, "still accepted %s after revoke", d)
		})
	}
}

func restConfigFor(host string) *rest.Config { return &rest.Config{Host: host, QPS: -1} }
