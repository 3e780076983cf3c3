package agent

import (
	"encoding/base64"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func TestMultiKueueFormatRefusesAKubeconfigKueueWouldRefuse(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	c.CAData = nil
	_, err := renderSecret(config.SecretOutput{Namespace: "kueue-system", Name: "east", Format: config.FormatMultiKueue}, goldenMeta, c)
	require.ErrorContains(t, err, "certificate-authority-data")
}

func TestTheAccessProviderEntryNamesTheBrokersClusterAndTheTarget(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	c.ProxyURL = "http://proxy:3128"
	meta := outputMeta{target: "east", broker: "https://broker.east:8443", req: config.RequestConfig{Namespace: "batch", ServiceAccount: "multikueue", TTL: "1h"}}
	e, err := accessProvider(meta, c)
	require.NoError(t, err)
	require.Equal(t, "tokenbroker", e["name"])
	cluster := e["cluster"].(map[string]any)
	require.Equal(t, c.Server, cluster["server"])
	require.Equal(t, base64.StdEncoding.EncodeToString(c.CAData), cluster["certificate-authority-data"], "base64 of the PEM, as in a kubeconfig")
	require.Equal(t, "http://proxy:3128", cluster["proxy-url"])
	require.Equal(t, []any{map[string]any{"name": "client.authentication.k8s.io/exec", "extension": map[string]any{
		"apiVersion": apiv1.PluginTargetAPIVersion, "kind": apiv1.PluginTargetKind,
		"broker": "https://broker.east:8443", "namespace": "batch", "serviceAccount": "multikueue", "ttl": "1h",
	}}}, cluster["extensions"])
	require.NotContains(t, cluster, "token", "no credential in a ClusterProfile")

	again, err := accessProvider(meta, goldenCredentialWithNewToken(t, c))
	require.NoError(t, err)
	require.Equal(t, e, again, "a new credential for the same cluster renders the same entry: no write")
}

// goldenCredentialWithNewToken is c with another lease and token.
func goldenCredentialWithNewToken(t *testing.T, c *Credential) *Credential {
	t.Helper()
	n := *c
	n.LeaseID, n.Token = "bbbbbbbbbbbbbbbbbbbbbbbbbb", "another-SECRET"
	return &n
}

func TestSetListEntryKeepsOtherProvidersAndReportsChange(t *testing.T) {
	t.Parallel()
	ours := map[string]any{"name": "tokenbroker", "cluster": map[string]any{"server": "https://a"}}
	other := map[string]any{"name": "secretreader", "cluster": map[string]any{"server": "https://a"}}
	list, changed := setListEntry([]any{other}, "name", "tokenbroker", ours)
	require.True(t, changed)
	require.Equal(t, []any{other, ours}, list)
	list, changed = setListEntry(list, "name", "tokenbroker", ours)
	require.False(t, changed, "the same entry is no change")
	require.Equal(t, []any{other, ours}, list)
	moved := map[string]any{"name": "tokenbroker", "cluster": map[string]any{"server": "https://b"}}
	list, changed = setListEntry(list, "name", "tokenbroker", moved)
	require.True(t, changed)
	require.Equal(t, []any{other, moved}, list)
}

func TestSetConditionMovesTheTransitionTimeOnlyWithTheStatus(t *testing.T) {
	t.Parallel()
	t1 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	healthy := metav1.Condition{Type: ConditionControlPlaneHealthy, Status: metav1.ConditionTrue, Reason: ReasonBrokerIssues, Message: "ok"}
	conds, changed := setCondition(nil, healthy, t1)
	require.True(t, changed)
	require.Equal(t, "2030-01-02T03:04:05Z", conds[0].(map[string]any)["lastTransitionTime"])
	_, changed = setCondition(conds, healthy, t1.Add(time.Hour))
	require.False(t, changed, "nothing to write while the broker stays healthy")
	down := metav1.Condition{Type: ConditionControlPlaneHealthy, Status: metav1.ConditionFalse, Reason: ReasonBrokerUnreachable, Message: "gone"}
	conds, changed = setCondition(conds, down, t1.Add(time.Hour))
	require.True(t, changed)
	require.Equal(t, "2030-01-02T04:04:05Z", conds[0].(map[string]any)["lastTransitionTime"])
	other := map[string]any{"type": "Joined", "status": "True"}
	conds, _ = setCondition(append(conds, other), healthy, t1.Add(2*time.Hour))
	require.Contains(t, conds, other, "another writer's condition is kept")
}
