package agent

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/agent/config"
	"k8s.io/client-go/kubernetes/fake"
)

var argoExec = &config.ArgoCDOptions{Exec: &config.ArgoCDExec{
	Command: "/tokenbroker/tokenbroker", IdentityDir: "/var/run/tokenbroker/identity",
	Env: map[string]string{"XDG_CACHE_HOME": "/tmp/cache"},
}}

// In exec mode the Argo CD cluster Secret names how to get a credential
// (the plugin with the target's own request) and holds none, so its
// config is the same for every credential.
func TestArgoCDExecModeWritesTheSameConfigForEveryCredential(t *testing.T) {
	t.Parallel()
	o := config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD, ArgoCD: argoExec}
	meta := goldenMeta
	meta.broker = "https://east.example.com:8443"
	meta.req = config.RequestConfig{Namespace: "apps", ServiceAccount: "argocd-manager", TTL: "1h", Audiences: []string{"a"}}
	c := goldenCredential(t)
	s1, err := renderSecret(o, meta, c)
	require.NoError(t, err)
	s2, err := renderSecret(o, meta, nextCredential(c))
	require.NoError(t, err)
	require.Equal(t, s1.Data, s2.Data, "a new credential changes nothing Argo CD reads")

	var cfg map[string]any
	require.NoError(t, json.Unmarshal(s1.Data[keyArgoConfig], &cfg))
	require.NotContains(t, cfg, "bearerToken")
	require.NotContains(t, string(s1.Data[keyArgoConfig]), c.Token)
	require.Equal(t, map[string]any{
		"command": "/tokenbroker/tokenbroker",
		"args": []any{"credential", "--broker", "https://east.example.com:8443", "--identity-dir", "/var/run/tokenbroker/identity",
			"--namespace", "apps", "--service-account", "argocd-manager", "--ttl", "1h", "--audience", "a"},
		"env":         map[string]any{"XDG_CACHE_HOME": "/tmp/cache"},
		"apiVersion":  "client.authentication.k8s.io/v1",
		"installHint": cfg["execProviderConfig"].(map[string]any)["installHint"],
	}, cfg["execProviderConfig"])
	require.Contains(t, cfg["tlsClientConfig"], "caData")
}

// The lease of a target whose outputs hold no credential only told the
// agent the cluster entry: it is revoked as soon as it is written, and
// not revoked twice when the next refresh replaces it.
func TestATargetWhoseOutputsHoldNoCredentialRevokesItsLeaseAtOnce(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	out := &secretOutput{cfg: config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD, ArgoCD: argoExec}, secrets: cs.CoreV1()}
	f := newRefresherFixture(t, config.RefreshConfig{}, out)
	ctx := context.Background()

	wake := f.r.step(ctx)
	require.Equal(t, t0, wake, "woken at once for the revocation")
	f.r.step(ctx)
	require.Equal(t, []string{leaseID(1)}, f.broker.revokedLeases())
	require.True(t, f.r.status().ready(), "the Secret is written and counts as held")

	f.clock.SetTime(t0.Add(40 * time.Minute))
	f.r.step(ctx)
	f.r.step(ctx)
	require.Equal(t, []string{leaseID(1), leaseID(2)}, f.broker.revokedLeases(), "each lease revoked once")
}
