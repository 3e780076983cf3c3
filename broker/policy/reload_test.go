package policy

import (
	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/pki"
)

func TestThePolicyWatcherSwapsGoodPoliciesAndRefusesBadOnes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "policy.yaml")
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ca.crt"), []byte(testCAPEM(t)), 0o600))
	write := func(doc string) {
		doc = strings.Replace(doc, `caData: "x"`, "caFile: ca.crt", 1)
		require.NoError(t, os.WriteFile(file, []byte(doc), 0o600))
	}
	write(policytest.Basic)
	p, err := LoadFile(file)
	require.NoError(t, err)
	store := NewStore(p)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	core, logs := observer.New(zap.InfoLevel)
	w, err := NewWatcher(file, store, zap.New(core), m, 0)
	require.NoError(t, err)

	require.NoError(t, w.Check(), "unchanged content is not reloaded")
	require.Same(t, p, store.Load())

	write(strings.Replace(policytest.Basic, "name: north", "name: north2", 1))
	require.NoError(t, w.Check())
	require.NotSame(t, p, store.Load())
	require.Equal(t, "north2", store.Load().Peers[1].Name)
	good := store.Load()

	write("cluster: [\n")
	require.Error(t, w.Check())
	require.Same(t, good, store.Load(), "a bad file leaves the policy in force")
	require.NoError(t, w.Check(), "the same bad content is reported once")

	require.NoError(t, os.Remove(file))
	require.Error(t, w.Check())
	require.NoError(t, w.Check())
	require.Same(t, good, store.Load())

	write(policytest.Basic)
	require.NoError(t, w.Check())
	require.Equal(t, "north", store.Load().Peers[1].Name)

	const want = `
# HELP tokenbroker_config_reloads_total Reloads of changed configuration files, by config (policy, server-certificate, client-ca) and result (success, failure).
# TYPE tokenbroker_config_reloads_total counter
tokenbroker_config_reloads_total{config="policy",result="failure"} 2
tokenbroker_config_reloads_total{config="policy",result="success"} 2
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "tokenbroker_config_reloads_total"))
	require.Equal(t, 2, logs.FilterMessage("policy reload refused; keeping the policy in force").Len())
	require.Equal(t, 2, logs.FilterMessage("policy reloaded").Len())
}

func TestThePolicyWatcherNoticesAChangedClusterCAFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "policy.yaml")
	caFile := filepath.Join(dir, "ca.crt")
	require.NoError(t, os.WriteFile(caFile, []byte(testCAPEM(t)), 0o600))
	require.NoError(t, os.WriteFile(file, []byte("cluster: {name: east, server: 'https://east.example.com', caFile: ca.crt}\n"), 0o600))
	p, err := LoadFile(file)
	require.NoError(t, err)
	store := NewStore(p)
	w, err := NewWatcher(file, store, zap.NewNop(), nil, 0)
	require.NoError(t, err)

	require.NoError(t, os.WriteFile(caFile, []byte("not PEM"), 0o600))
	require.Error(t, w.Check(), "a broken CA file is refused")
	require.Same(t, p, store.Load())
	require.NoError(t, os.WriteFile(caFile, []byte(testCAPEM(t)+testCAPEM(t)), 0o600))
	require.NoError(t, w.Check())
	require.NotSame(t, p, store.Load())
}

func TestPeerCertificateTTLIsValidated(t *testing.T) {
	t.Parallel()
	for ttl, ok := range map[string]bool{"1h": true, "720h": true, "10m": true, "721h": false, "5m": false} {
		doc := strings.Replace(policytest.Basic, "    identity: spiffe://oc.example/cluster/west\n",
			"    identity: spiffe://oc.example/cluster/west\n    certificateTTL: "+ttl+"\n", 1)
		_, err := Parse([]byte(doc))
		if ok {
			require.NoError(t, err, ttl)
			continue
		}
		var ve *apiv1.ValidationError
		require.ErrorAs(t, err, &ve, ttl)
		require.Equal(t, "peers[0].certificateTTL", ve.Problems[0].Field)
	}
}

func testCAPEM(t *testing.T) string {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	return string(ca.BundlePEM())
}
