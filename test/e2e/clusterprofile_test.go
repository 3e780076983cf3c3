package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

// consumerClusterProfile is cluster-inventory-api at the version Kueue
// v0.17.0 pins (pkg/credentials).
const consumerClusterProfile = "clusterprofile"

var clusterProfileGVR = struct{ group, version, resource string }{"multicluster.x-k8s.io", "v1alpha1", "clusterprofiles"}

// installClusterProfileCRD applies the ClusterProfile CRD from the module
// cache of the pinned nested module (config/crd/bases), so the CRD is the
// one the consumer's code was written against.
func installClusterProfileCRD(t *testing.T, kubeconfig string) {
	t.Helper()
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/cluster-inventory-api")
	cmd.Dir = filepath.Join(repoRoot(t), "test", "conformance", "consumers", consumerClusterProfile)
	out, err := cmd.Output()
	require.NoError(t, err)
	crd := filepath.Join(strings.TrimSpace(string(out)), "config", "crd", "bases", "multicluster.x-k8s.io_clusterprofiles.yaml")
	run(t, kubectlBinary(t), "--kubeconfig", kubeconfig, "apply", "-f", crd)
	run(t, kubectlBinary(t), "--kubeconfig", kubeconfig, "wait", "--for", "condition=established", "--timeout", "60s", "crd/clusterprofiles.multicluster.x-k8s.io")
}

// TestClusterProfileAccessProviderWithClusterInventoryAPI is issue 21's
// conformance of the access provider: the agent in west publishes east on
// a ClusterProfile; cluster-inventory-api's own NewFromFile and
// BuildConfigFromCP, with a provider file that runs our plugin, build a
// client that lists what the ServiceAccount may and is refused elsewhere;
// 20 clients built at once make one lease; and a profile whose server was
// changed gets no token.
func TestClusterProfileAccessProviderWithClusterInventoryAPI(t *testing.T) {
	t.Parallel()
	bin := consumerBinary(t, consumerClusterProfile)
	east, west := startTwoClusters(t)
	setUpTarget(t, east)
	installClusterProfileCRD(t, west.KubeconfigPath)
	e := newBrokerEnv(t, east)
	e.launch(t)

	idDir := t.TempDir()
	for src, dst := range map[string]string{"west.crt": "tls.crt", "west.key": "tls.key", filepath.Join("pki", "ca.crt"): "ca.crt"} {
		raw, err := os.ReadFile(filepath.Join(e.dir, src))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(idDir, dst), raw, 0o600))
	}
	_, err := west.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kueue-system"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity:
  dir: %s
targets:
  - name: east
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 1h}
    outputs:
      - clusterProfile: {namespace: kueue-system, clusterManager: tokenbroker}
kubeconfig: %s
opsAddress: %q
`, idDir, e.api, west.KubeconfigPath, ops))
	agentProc := startAgent(t, cfg)
	agentProc.waitReady(t)

	dyn, err := dynamic.NewForConfig(west.Config)
	require.NoError(t, err)
	cps := dyn.Resource(clusterProfileResource()).Namespace("kueue-system")
	var cp *unstructured.Unstructured
	require.Eventually(t, func() bool {
		cp, err = cps.Get(context.Background(), "east", metav1.GetOptions{})
		if err != nil {
			return false
		}
		ps, _, _ := unstructured.NestedSlice(cp.Object, "status", "accessProviders")
		return len(ps) == 1
	}, agentSecretsWait, 200*time.Millisecond, "the agent's access provider entry")
	require.Equal(t, "tokenbroker", cp.GetLabels()["x-k8s.io/cluster-manager"])
	conds, _, _ := unstructured.NestedSlice(cp.Object, "status", "conditions")
	require.Len(t, conds, 1)
	require.Equal(t, "True", conds[0].(map[string]any)["status"], "ControlPlaneHealthy from a broker that issues")
	rv := cp.GetResourceVersion()

	providerFile := writeFile(t, filepath.Join(t.TempDir(), "providers.json"), fmt.Sprintf(`{"providers":[{"name":"tokenbroker","execConfig":{
  "apiVersion":"client.authentication.k8s.io/v1","command":%q,"args":["credential"],
  "env":[{"name":"TOKENBROKER_IDENTITY_DIR","value":%q},{"name":"XDG_CACHE_HOME","value":%q}],
  "provideClusterInfo":true}}]}`, tokenbrokerBinary(t), idDir, t.TempDir()))
	runCheck := func(listNS string, parallel int) (check.Result, string, error) {
		args := check.Args{Kubeconfig: west.KubeconfigPath, Namespace: "kueue-system", Name: "east", ListNamespace: listNS}
		cmd := exec.Command(bin, args.CommandLine()...)
		cmd.Env = append(os.Environ(), "CLUSTERPROFILE_PROVIDER_FILE="+providerFile, fmt.Sprintf("CLUSTERPROFILE_PARALLEL=%d", parallel))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var r check.Result
		if err == nil {
			require.NoError(t, json.Unmarshal(out, &r), string(out))
		}
		return r, stderr.String(), err
	}

	// The agent revokes the lease its health check took just after it
	// writes the profile: count new lease ids, not a difference of counts.
	leasesBefore := leaseSecretIDs(t, east)
	r, stderr, err := runCheck("argo", 20)
	require.NoError(t, err, stderr)
	require.Equal(t, 200, r.Status, r.Error)
	require.Equal(t, []string{"hello"}, r.ConfigMaps)
	require.Equal(t, east.URL, r.Server)
	leases := newLeases(t, east, leasesBefore)
	t.Logf("20 clients built in parallel with BuildConfigFromCP made %d lease(s)", leases)
	require.Equal(t, 1, leases)

	r, stderr, err = runCheck("default", 1)
	require.NoError(t, err, stderr)
	require.Equal(t, 403, r.Status, "the ServiceAccount may list only in argo")

	// Nothing changed: the agent wrote the profile once.
	cp, err = cps.Get(context.Background(), "east", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, rv, cp.GetResourceVersion(), "written only on change")

	// Someone who can write ClusterProfiles points the entry elsewhere.
	ps, _, _ := unstructured.NestedSlice(cp.Object, "status", "accessProviders")
	entry := ps[0].(map[string]any)
	entry["cluster"].(map[string]any)["server"] = "https://127.0.0.2" + strings.TrimPrefix(east.URL, "https://127.0.0.1")
	require.NoError(t, unstructured.SetNestedSlice(cp.Object, ps, "status", "accessProviders"))
	_, err = cps.UpdateStatus(context.Background(), cp, metav1.UpdateOptions{})
	require.NoError(t, err)
	leasesBefore = leaseSecretIDs(t, east)
	r, stderr, err = runCheck("argo", 1)
	if err == nil {
		require.NotEqual(t, 200, r.Status, "a changed server must get no token")
	}
	require.Contains(t, stderr+r.Error, "refused: the credential would go to a cluster the broker does not name")
	require.Zero(t, newLeases(t, east, leasesBefore), "nothing issued for a changed server")
}

func clusterProfileResource() schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: clusterProfileGVR.group, Version: clusterProfileGVR.version, Resource: clusterProfileGVR.resource}
}
