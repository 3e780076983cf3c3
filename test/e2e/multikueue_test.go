package e2e

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// consumerMultiKueue runs Kueue v0.17.0's own controllers
// (test/conformance/consumers/multikueue).
const consumerMultiKueue = "multikueue"

var (
	multiKueueClusterGVR = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "multikueueclusters"}
	workloadGVR          = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "workloads"}
)

// installKueueCRDs applies Kueue's CRDs from the module cache of the
// pinned nested module (config/components/crd/bases), server-side because
// the Workload CRD is too large for the last-applied annotation.
func installKueueCRDs(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kueue")
	cmd.Dir = filepath.Join(repoRoot(t), "test", "conformance", "consumers", consumerMultiKueue)
	out, err := cmd.Output()
	require.NoError(t, err)
	dir := filepath.Join(strings.TrimSpace(string(out)), "config", "components", "crd", "bases")
	kubectl := kubectlBinary(t)
	run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "apply", "--server-side", "-f", dir)
	// kubectl wait fails on a CRD whose status is not written yet.
	require.Eventually(t, func() bool {
		_, _, err := runErr(kubectl, "--kubeconfig", c.KubeconfigPath, "wait", "--for", "condition=established", "--timeout", "30s",
			"crd/workloads.kueue.x-k8s.io", "crd/multikueueclusters.kueue.x-k8s.io", "crd/clusterqueues.kueue.x-k8s.io",
			"crd/localqueues.kueue.x-k8s.io", "crd/admissionchecks.kueue.x-k8s.io", "crd/multikueueconfigs.kueue.x-k8s.io",
			"crd/resourceflavors.kueue.x-k8s.io")
		return err == nil
	}, 90*time.Second, 500*time.Millisecond, "Kueue's CRDs established")
}

// kueueQueues is a ResourceFlavor, a ClusterQueue and the LocalQueue
// team-a/user-queue; the manager's ClusterQueue requires the MultiKueue
// admission check.
func kueueQueues(admissionCheck string) string {
	checks := ""
	if admissionCheck != "" {
		checks = "\n  admissionChecksStrategy: {admissionChecks: [{name: " + admissionCheck + "}]}"
	}
	return `apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: default}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: cq}
spec:
  namespaceSelector: {}
  resourceGroups:
    - coveredResources: [cpu, memory]
      flavors:
        - name: default
          resources:
            - {name: cpu, nominalQuota: "4"}
            - {name: memory, nominalQuota: 4Gi}` + checks + `
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {namespace: team-a, name: user-queue}
spec: {clusterQueue: cq}
`
}

// multiKueueJob is a Job as Kueue's Job webhook leaves it in a manager
// whose queue uses MultiKueue (the webhook is not run here): suspended,
// queued by label, managed by MultiKueue.
func multiKueueJob(name string) string {
	return fmt.Sprintf(`apiVersion: batch/v1
kind: Job
metadata:
  namespace: team-a
  name: %s
  labels: {kueue.x-k8s.io/queue-name: user-queue}
spec:
  suspend: true
  managedBy: kueue.x-k8s.io/multikueue
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: main
          image: registry.k8s.io/e2e-test-images/agnhost:2.53
          args: [pause]
          resources: {requests: {cpu: 100m, memory: 64Mi}}
`, name)
}

// condition returns the status and last transition time of an object's
// condition of the given type.
func condition(u *unstructured.Unstructured, typ string) (status, since string) {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == typ {
			s, _ := m["status"].(string)
			l, _ := m["lastTransitionTime"].(string)
			return s, l
		}
	}
	return "", ""
}

// jtiOf returns the jti claim of a JWT without verifying it (the token
// never leaves the test; only its jti is logged).
func jtiOf(t *testing.T, token string) string {
	t.Helper()
	parts := strings.Split(token, ".")
	require.Len(t, parts, 3)
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	require.NoError(t, err)
	var claims struct {
		JTI string `json:"jti"`
	}
	require.NoError(t, json.Unmarshal(raw, &claims))
	require.NotEmpty(t, claims.JTI)
	return claims.JTI
}

// auditEvent is the part of a kube-apiserver audit event the test reads.
type auditEvent struct {
	Verb      string `json:"verb"`
	RequestAt string `json:"requestReceivedTimestamp"`
	User      struct {
		Username string              `json:"username"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	ObjectRef struct {
		Resource  string `json:"resource"`
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
}

func readAudit(t *testing.T, path string) []auditEvent {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	defer f.Close()
	var evs []auditEvent
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		var ev auditEvent
		if json.Unmarshal(sc.Bytes(), &ev) == nil {
			evs = append(evs, ev)
		}
	}
	return evs
}

// createdWith returns the credential id (JTI=…) of the token that created
// the Job copy name in east, or "" if the audit log has no such request.
func createdWith(t *testing.T, auditLog, name string) string {
	t.Helper()
	for _, ev := range readAudit(t, auditLog) {
		if ev.Verb == "create" && ev.ObjectRef.Resource == "jobs" && ev.ObjectRef.Name == name && ev.ResponseStatus.Code == 201 {
			require.Equal(t, "system:serviceaccount:kueue-system:multikueue", ev.User.Username)
			return strings.Join(ev.User.Extra["authentication.kubernetes.io/credential-id"], ",")
		}
	}
	return ""
}

// TestMultiKueueDispatchesWithTheAgentsSecretAndKeepsItsClusterActiveAcrossARotation
// is issue 21's MultiKueue end to end with Kueue v0.17.0's own
// controllers: east is the worker (a broker, the ServiceAccount with
// exactly the RBAC of docs/guides/multikueue.md, and Kueue's core
// controllers, which admit the remote Workload), west the manager (the
// agent writing the guide's multikueue Secret into kueue-system, and
// Kueue's core and MultiKueue controllers reading it). A Job submitted in
// west is created in east by the brokered ServiceAccount; after the agent
// rotates the credential the MultiKueueCluster stays Active without a
// restart, Kueue's next request to east carries the new token (measured
// from east's audit log), the old lease is revoked, and a second Job is
// dispatched with the new token.
func TestMultiKueueDispatchesWithTheAgentsSecretAndKeepsItsClusterActiveAcrossARotation(t *testing.T) {
	t.Parallel()
	testMultiKueue(t, false)
}

// TestMultiKueueDispatchesThroughAClusterProfileAndThePlugin is the
// guide's second path with Kueue v0.17.0's controllers: the feature gate
// MultiKueueClusterProfile on and the guide's credentialsProviders in
// Kueue's configuration, the agent publishing the tokenbroker access
// provider on west's ClusterProfile, and Kueue running `tokenbroker
// credential` in its own process to reach east. A Job is dispatched with
// the plugin's token.
func TestMultiKueueDispatchesThroughAClusterProfileAndThePlugin(t *testing.T) {
	t.Parallel()
	testMultiKueue(t, true)
}

// testMultiKueue runs the MultiKueue end-to-end test through the agent's
// Secret or, viaProfile, through a ClusterProfile and the plugin.
func testMultiKueue(t *testing.T, viaProfile bool) {
	bin := consumerBinary(t, consumerMultiKueue)
	kubectl := kubectlBinary(t)
	guide := readDoc(t, "docs/guides/multikueue.md")

	// east's audit log records every request of the brokered
	// ServiceAccount with the jti of its token.
	auditDir := t.TempDir()
	pol := writeFile(t, filepath.Join(auditDir, "policy.yaml"), `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["system:serviceaccount:kueue-system:multikueue"]
  - level: None
`)
	auditLog := filepath.Join(auditDir, "audit.log")
	var east, west *testcluster.Cluster
	var wg sync.WaitGroup
	wg.Go(func() {
		east = testcluster.Start(t, testcluster.WithAPIServerArgs("--audit-policy-file="+pol, "--audit-log-path="+auditLog))
	})
	wg.Go(func() { west = testcluster.Start(t) })
	wg.Wait()
	require.NotNil(t, east)
	require.NotNil(t, west)
	wg.Go(func() { installKueueCRDs(t, east) })
	wg.Go(func() { installKueueCRDs(t, west) })
	wg.Wait()

	// The worker: the ServiceAccount with the guide's RBAC, a broker
	// granting it to west, Kueue and its queues.
	ctx := context.Background()
	setUpMultiKueueWorker(t, kubectl, guide, east, west)
	e := newBrokerEnv(t, east)
	writeFile(t, e.policy, fmt.Sprintf(`cluster:
  name: east
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants:
      - namespaces: [kueue-system]
        serviceAccounts: [multikueue]
`, east.URL))
	e.launch(t)
	startProcess(t, bin, "--role", "worker", "--kubeconfig", east.KubeconfigPath)
	applyYAML(t, kubectl, east, kueueQueues(""))

	// The manager: the agent with the guide's target (a 10-minute token
	// refreshed at 2 %, about every 12 s; the old lease revoked 5 s
	// after the switch), Kueue, and the guide's MultiKueueCluster.
	idDir := t.TempDir()
	for src, dst := range map[string]string{"west.crt": "tls.crt", "west.key": "tls.key", filepath.Join("pki", "ca.crt"): "ca.crt"} {
		raw, err := os.ReadFile(filepath.Join(e.dir, src))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(idDir, dst), raw, 0o600))
	}
	const grace = 5 * time.Second
	targets := replaceAll(t, fencedBlock(t, guide, "yaml", "targets:\n  - name: worker1"),
		"https://broker.worker1.example.com:8443", "https://"+e.api, "ttl: 2h", "ttl: 10m")
	mkCluster := fencedBlock(t, guide, "yaml", "apiVersion: kueue.x-k8s.io/v1beta2\nkind: MultiKueueCluster\nmetadata: {name: worker1}\nspec:\n  clusterSource:\n    kubeConfig")
	managerArgs := []string{"--role", "manager", "--kubeconfig", west.KubeconfigPath}
	if viaProfile {
		installClusterProfileCRD(t, west.KubeconfigPath)
		output := fencedBlock(t, guide, "yaml", "    outputs:\n      - clusterProfile:")
		targets = targets[:strings.Index(targets, "    outputs:\n")] + output
		mkCluster = fencedBlock(t, guide, "yaml", "apiVersion: kueue.x-k8s.io/v1beta2\nkind: MultiKueueCluster\nmetadata: {name: worker1}\nspec:\n  clusterSource:\n    clusterProfileRef")
		kueueConfig := replaceAll(t, fencedBlock(t, guide, "yaml", "# Kueue v0.15 – v0.18"),
			"/plugins/tokenbroker", tokenbrokerBinary(t), "/var/run/tokenbroker/identity", idDir, "/var/cache/plugins", t.TempDir())
		managerArgs = append(managerArgs, "--config", writeFile(t, filepath.Join(t.TempDir(), "kueue.yaml"),
			"apiVersion: config.kueue.x-k8s.io/v1beta2\nkind: Configuration\nnamespace: kueue-system\n"+kueueConfig))
	}
	ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity:
  dir: %s
refresh: {fraction: 0.02, jitter: 0.01, minBackoff: 500ms, maxBackoff: 2s, revokeGrace: %s}
kubeconfig: %s
opsAddress: %q
%s`, idDir, grace, west.KubeconfigPath, ops, targets))
	var first <-chan time.Time
	if !viaProfile {
		first = watchAdded(t, west, "kueue-system", "worker1")
	}
	agentProc := startAgent(t, cfg)
	if !viaProfile {
		waitTime(t, first, agentSecretsWait, "the agent's multikueue Secret")
	}
	agentProc.waitReady(t)
	manager := startProcess(t, bin, managerArgs...)
	applyYAML(t, kubectl, west, multiKueueManagerObjects(mkCluster))

	westDyn := dynamic.NewForConfigOrDie(west.Config)
	mkc := westDyn.Resource(multiKueueClusterGVR)
	var active string
	require.Eventually(t, func() bool {
		u, err := mkc.Get(ctx, "worker1", metav1.GetOptions{})
		if err != nil {
			return false
		}
		var s string
		s, active = condition(u, "Active")
		return s == "True"
	}, 60*time.Second, 250*time.Millisecond, "MultiKueueCluster worker1 Active=True (the processes' logs follow a failure)")

	// dispatch submits a Job in west and waits for the proof of dispatch:
	// the manager Workload's admission check Ready, and a Job of the same
	// name in east labelled with MultiKueue's origin.
	dispatch := func(t *testing.T, name string) {
		t.Helper()
		applyYAML(t, kubectl, west, multiKueueJob(name))
		var msg string
		require.Eventually(t, func() bool {
			l, err := westDyn.Resource(workloadGVR).Namespace("team-a").List(ctx, metav1.ListOptions{})
			if err != nil {
				return false
			}
			for _, w := range l.Items {
				if len(w.GetOwnerReferences()) == 0 || w.GetOwnerReferences()[0].Name != name {
					continue
				}
				checks, _, _ := unstructured.NestedSlice(w.Object, "status", "admissionChecks")
				for _, c := range checks {
					m, _ := c.(map[string]any)
					if m["name"] == "multikueue" && m["state"] == "Ready" {
						msg, _ = m["message"].(string)
						return true
					}
				}
			}
			return false
		}, 60*time.Second, 250*time.Millisecond, "the manager Workload of Job %s has its MultiKueue check Ready", name)
		require.Contains(t, msg, `"worker1"`, "the check names the worker")
		job, err := east.Client.BatchV1().Jobs("team-a").Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err, "the Job copy in the worker")
		require.Contains(t, job.Labels, "kueue.x-k8s.io/multikueue-origin")
		t.Logf("Job %s dispatched to worker1: %q", name, msg)
	}
	dispatch(t, "sample-1")

	// The Job copy was created in east by the brokered ServiceAccount
	// with a token of the broker's (the audit policy records no one
	// else).
	require.NotEmpty(t, createdWith(t, auditLog, "sample-1"), "east's audit log has the brokered ServiceAccount creating the Job copy")
	if viaProfile {
		return
	}
	sec := getSecret(t, west, "kueue-system", "worker1")
	jti1 := jtiOf(t, tokenOf(t, sec.Data["kubeconfig"]))

	// From here until the end the MultiKueueCluster must stay Active,
	// never flipping (its lastTransitionTime unchanged).
	stopSampling := make(chan struct{})
	var sampling sync.WaitGroup
	var flips []string
	sampling.Go(func() {
		for {
			select {
			case <-stopSampling:
				return
			case <-time.After(200 * time.Millisecond):
			}
			u, err := mkc.Get(ctx, "worker1", metav1.GetOptions{})
			if err != nil {
				continue
			}
			if s, since := condition(u, "Active"); s != "True" || since != active {
				flips = append(flips, s+" since "+since)
			}
		}
	})

	// The rotation: the time the Secret changed, then the first request
	// Kueue made in east with the new token.
	w, err := west.Client.CoreV1().Secrets("kueue-system").Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", "worker1").String(), ResourceVersion: sec.ResourceVersion})
	require.NoError(t, err)
	var rotated time.Time
	var jti2, lease2 string
	timeout := time.After(60 * time.Second)
	for rotated.IsZero() {
		select {
		case ev, ok := <-w.ResultChan():
			require.True(t, ok, "the Secret watch ended")
			s, isSecret := ev.Object.(*corev1.Secret)
			if ev.Type == watch.Modified && isSecret && s.Annotations[annLeaseID] != sec.Annotations[annLeaseID] {
				rotated = time.Now()
				jti2 = jtiOf(t, tokenOf(t, s.Data["kubeconfig"]))
				lease2 = s.Annotations[annLeaseID]
			}
		case <-timeout:
			t.Fatal("the agent did not rotate the Secret within 60s")
		}
	}
	w.Stop()
	var usedAt time.Time
	require.Eventually(t, func() bool {
		for _, ev := range readAudit(t, auditLog) {
			if ev.User.Username != "system:serviceaccount:kueue-system:multikueue" {
				continue
			}
			if ids := ev.User.Extra["authentication.kubernetes.io/credential-id"]; len(ids) == 1 && ids[0] == "JTI="+jti2 {
				usedAt, err = time.Parse(time.RFC3339Nano, ev.RequestAt)
				require.NoError(t, err)
				return true
			}
		}
		return false
	}, 30*time.Second, 100*time.Millisecond, "Kueue makes a request to east with the rotated token")
	pickedUp := usedAt.Sub(rotated)
	t.Logf("Secret rotated to lease %s (jti %s); Kueue's first request to east with it %s later", lease2, jti2, pickedUp.Round(time.Millisecond))
	require.Less(t, pickedUp, 10*time.Second, "MultiKueue uses a rotated Secret within seconds")

	// The old lease is revoked after the grace; a new Job is dispatched,
	// and the Job copy is created with the new token.
	require.Eventually(t, func() bool { return !tokenValid(t, east, tokenOf(t, sec.Data["kubeconfig"])) },
		grace+20*time.Second, 250*time.Millisecond, "the previous lease is revoked after the grace")
	t.Logf("the previous token refused %s after the rotation", time.Since(rotated).Round(100*time.Millisecond))
	dispatch(t, "sample-2")
	with := createdWith(t, auditLog, "sample-2")
	require.NotEmpty(t, with)
	require.NotEqual(t, "JTI="+jti1, with, "the second Job copy was created with a rotated token, not the revoked one")

	// The guide's RBAC is enough: nothing Kueue asked east was forbidden.
	used := map[string]bool{}
	for _, ev := range readAudit(t, auditLog) {
		require.NotEqual(t, 403, ev.ResponseStatus.Code, "Kueue was refused %s %s: the guide's RBAC lacks it", ev.Verb, ev.ObjectRef.Resource)
		used[ev.Verb+" "+ev.ObjectRef.Resource] = true
	}
	t.Logf("what Kueue's manager did in east: %v", slices.Sorted(maps.Keys(used)))

	close(stopSampling)
	sampling.Wait()
	require.Empty(t, flips, "MultiKueueCluster worker1 stayed Active (since %s) across the rotation", active)
	select {
	case err := <-manager.done:
		t.Fatalf("Kueue's manager exited: %v", err)
	default:
	}
	require.Equal(t, 1, strings.Count(manager.logs.String(), "starting Kueue"), "Kueue was not restarted")
}

// setUpMultiKueueWorker makes kueue-system in both clusters and, in the
// worker east, the ServiceAccount multikueue with the guide's RBAC.
func setUpMultiKueueWorker(t *testing.T, kubectl, guide string, east, west *testcluster.Cluster) {
	t.Helper()
	ctx := t.Context()
	for _, c := range []*testcluster.Cluster{east, west} {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kueue-system"}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	_, err := east.Client.CoreV1().ServiceAccounts("kueue-system").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "multikueue"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	applyYAML(t, kubectl, east, fencedBlock(t, guide, "yaml", "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata: {name: multikueue-remote}"))
}

// multiKueueManagerObjects are the manager's queues, its MultiKueue
// AdmissionCheck and config naming the worker worker1, and cluster, the
// worker's MultiKueueCluster.
func multiKueueManagerObjects(cluster string) string {
	return kueueQueues("multikueue") + `---
apiVersion: kueue.x-k8s.io/v1beta2
kind: AdmissionCheck
metadata: {name: multikueue}
spec:
  controllerName: kueue.x-k8s.io/multikueue
  parameters: {apiGroup: kueue.x-k8s.io, kind: MultiKueueConfig, name: workers}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: MultiKueueConfig
metadata: {name: workers}
spec:
  clusters: [worker1]
---
` + cluster
}
