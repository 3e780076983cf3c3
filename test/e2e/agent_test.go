package e2e

import (
	"bufio"
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The annotations and label the agent puts on the Secrets it writes
// (docs/agent.md, "Outputs").
const (
	annLeaseID       = "tokenbroker.io/lease-id"
	labelManagedBy   = "app.kubernetes.io/managed-by"
	managedByAgent   = "tokenbroker-agent"
	admiraltyGuide   = "docs/guides/admiralty.md"
	argoCDGuide      = "docs/guides/argocd.md"
	fluxGuide        = "docs/guides/flux.md"
	kargoGuide       = "docs/guides/kargo.md"
	capsuleGuide     = "docs/guides/capsule.md"
	agentSecretsWait = 30 * time.Second
)

// TestAgentKeepsKubeconfigsFreshAcrossTwoClusters runs the agent as users
// do, as a `tokenbroker agent` process, between two real clusters: "east"
// runs the broker, "west" the agent, which writes into west's API server.
// Three agents run at once, each its own peer of the broker:
//
//   - west runs docs/guides/admiralty.md as written (its agent.yaml, its
//     east-side YAML, its kubectl check), with nothing but the least
//     privilege of deploy/agent/rbac.yaml in west, and enrolls itself with
//     a join token into an identity Secret;
//   - north (identity directory enrolled beforehand with `tokenbroker
//     enroll`) refreshes a 10-minute token after 2 % of its lifetime,
//     renews a 10-minute client certificate, and lives through a broker
//     outage;
//   - south enrolls itself into a directory and keeps 10 targets in every
//     output format, whose Argo CD and Flux Secrets are read back as those
//     guides show.
func TestAgentKeepsKubeconfigsFreshAcrossTwoClusters(t *testing.T) {
	t.Parallel()
	east, west := startTwoClusters(t)
	kubectl := kubectlBinary(t)
	bin := tokenbrokerBinary(t)
	root := repoRoot(t)
	guide := readDoc(t, admiraltyGuide)

	// east: Admiralty's custom resources (so the guide's Source applies as
	// written), stand-ins for the ClusterRoles Admiralty's chart installs,
	// and the guide's objects.
	applyYAML(t, kubectl, east, admiraltyCRDs)
	waitEstablished(t, kubectl, east.KubeconfigPath, "crd/sources.multicluster.admiralty.io", "crd/targets.multicluster.admiralty.io")
	applyYAML(t, kubectl, east, admiraltyClusterRoles)
	applyYAML(t, kubectl, east, fencedBlock(t, guide, "yaml", "# east: kubectl apply -f source.yaml"))
	applyYAML(t, kubectl, east, fencedBlock(t, guide, "yaml", "# east, only without Admiralty's source controller"))

	// The broker in east: the PKI and arguments of startBroker, with the
	// signing CA, the enrollment listener and the guide's policy (hosts
	// and paths replaced) plus the two test peers.
	e := newBrokerEnv(t, east)
	pkiDir := filepath.Join(e.dir, "pki")
	enrollAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	pol := replaceAll(t, fencedBlock(t, guide, "yaml", "cluster:"),
		"https://east.example.com:6443", east.URL,
		"/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", "cluster-ca.crt",
		"spiffe://oc.example/cluster/west", "spiffe://e2e.example/cluster/west",
	) + `  - name: north
    identity: spiffe://e2e.example/cluster/north
    certificateTTL: 10m
    grants:
      - namespaces: [argo]
        serviceAccounts: [admiralty-source]
  - name: south
    identity: spiffe://e2e.example/cluster/south
    grants:
      - namespaces: [argo]
        serviceAccounts: [admiralty-source]
`
	writeFile(t, e.policy, pol)
	e.args = append(e.args, "--enroll-address", enrollAddr, "--namespace", "default",
		"--ca-cert-file", filepath.Join(pkiDir, "ca.crt"), "--ca-key-file", filepath.Join(pkiDir, "ca.key"))
	e.launch(t)

	joinToken := func(t *testing.T, cluster string) (file, fingerprint string) {
		stdout, stderr, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", cluster, "--audience", "east", "--ttl", "10m")
		require.NoError(t, err, stderr)
		fingerprint = fingerprintRE.FindString(stderr)
		require.NotEmpty(t, fingerprint, stderr)
		file = filepath.Join(t.TempDir(), cluster+".token")
		require.NoError(t, os.WriteFile(file, []byte(stdout), 0o600))
		return file, fingerprint
	}

	// west: the namespaces the outputs live in, Admiralty's CRDs, and the
	// ServiceAccount and Roles of deploy/agent.
	for _, ns := range []string{"argo", "argocd", "flux-system"} {
		_, err := west.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	applyYAML(t, kubectl, west, admiraltyCRDs)
	waitEstablished(t, kubectl, west.KubeconfigPath, "crd/targets.multicluster.admiralty.io")
	var agentRBAC strings.Builder
	for _, d := range splitManifests(t, run(t, kubectl, "kustomize", filepath.Join(root, "deploy", "agent"))) {
		switch d.Kind {
		case "Namespace", "ServiceAccount", "Role", "RoleBinding":
			agentRBAC.WriteString("---\n")
			agentRBAC.Write(d.raw)
		}
	}
	applyYAML(t, kubectl, west, agentRBAC.String())

	// north: enrolled beforehand, with a certificate of the policy's 10
	// minutes. renewAt is a fraction of the lifetime from issuance (the
	// backdated NotBefore plus pki.Backdate); it is computed to fall about
	// 8 s from now, before the first refresh (after 12 s), which then goes
	// out with the renewed certificate.
	northDir := filepath.Join(t.TempDir(), "north")
	tf, fp := joinToken(t, "north")
	run(t, bin, "enroll", "--broker", "https://"+enrollAddr, "--ca-fingerprint", fp, "--token-file", tf, "--dir", northDir)
	northCert := readCert(t, filepath.Join(northDir, "tls.crt"))
	issued := northCert.NotBefore.Add(pki.Backdate)
	validity := northCert.NotAfter.Sub(issued)
	require.InDelta(t, 10*time.Minute, northCert.NotAfter.Sub(time.Now()), float64(time.Minute), "the policy's certificateTTL")
	renewAt := float64(time.Since(issued)+8*time.Second) / float64(validity)
	northOps := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	northCfg := writeFile(t, filepath.Join(t.TempDir(), "north.yaml"), fmt.Sprintf(`identity:
  dir: %s
  renewAt: %.4f
refresh: {fraction: 0.02, jitter: 0.01, minBackoff: 500ms, maxBackoff: 2s, revokeGrace: 3s}
targets:
  - name: east
    broker: https://%s
    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 10m}
    outputs:
      - secret: {namespace: argo, name: east-north, format: admiralty}
kubeconfig: %s
opsAddress: %q
`, northDir, renewAt, e.api, west.KubeconfigPath, northOps))
	northFirst := watchAdded(t, west, "argo", "east-north")
	north := startAgent(t, northCfg)
	northWritten := waitTime(t, northFirst, agentSecretsWait, "north's first Secret")
	t.Logf("north (enrolled beforehand): first Secret written %s after the agent started", northWritten.Sub(north.started).Round(time.Millisecond))
	firstNorth := getSecret(t, west, "argo", "east-north")

	// First and on its own, because it watches a moment: the refresh 12 s
	// after north's first write, and the revocation 3 s later.
	t.Run("with a refresh fraction of 2 % the agent refreshes a 10-minute token after about 12 s and revokes the old lease afterwards", func(t *testing.T) {
		lease1 := firstNorth.Annotations[annLeaseID]
		token1 := tokenOf(t, firstNorth.Data["config"])
		require.True(t, tokenValid(t, east, token1))

		sec := waitSecret(t, west, "argo", "east-north", 30*time.Second, func(s *corev1.Secret) bool { return s.Annotations[annLeaseID] != lease1 })
		switched := time.Now()
		t.Logf("north refreshed %s after its first write", switched.Sub(northWritten).Round(100*time.Millisecond))
		lease2 := sec.Annotations[annLeaseID]
		require.True(t, tokenValid(t, east, tokenOf(t, sec.Data["config"])))
		leases := leaseIDs(t, e, northDir)
		require.Contains(t, leases, lease2)
		require.Contains(t, leases, lease1, "the old lease lives on for revokeGrace (3s) after the new one is written")

		require.Eventually(t, func() bool { return !slices.Contains(leaseIDs(t, e, northDir), lease1) }, 10*time.Second, 100*time.Millisecond,
			"the replaced lease is revoked: GET /v1/leases no longer lists it")
		t.Logf("the replaced lease was revoked %s after the new credential was written (revokeGrace 3s)", time.Since(switched).Round(100*time.Millisecond))
		require.Eventually(t, func() bool { return !tokenValid(t, east, token1) }, 20*time.Second, 200*time.Millisecond,
			"with its lease gone, east's API server rejects the old token")
		t.Logf("east rejects the old token %s after the new credential was written (the API server caches token reviews briefly)", time.Since(switched).Round(100*time.Millisecond))
		require.GreaterOrEqual(t, north.metric(t, "tokenbroker_agent_revocations_total", "result", "success"), 1.0)
		_, exposition := north.get(t, "/metrics")
		requireDocumentedExposition(t, exposition, 5)
	})

	// The other agents and checks do not depend on timing.
	t.Run("three agents run at once against one broker", func(t *testing.T) {
		t.Run("the Admiralty guide runs as written: the agent enrolls itself and real kubectl reaches east as admiralty-source", func(t *testing.T) {
			t.Parallel()
			tokenFile, fp := joinToken(t, "west")
			ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
			// The guide's agent.yaml with hosts, the fingerprint and paths
			// replaced, and the least-privilege kubeconfig of deploy/agent's
			// ServiceAccount added (in a pod the agent runs in-cluster).
			cfg := replaceAll(t, fencedBlock(t, guide, "yaml", "identity:"),
				"https://east.example.com:8444", "https://"+enrollAddr,
				"https://east.example.com:8443", "https://"+e.api,
				"sha256:3943bf19c5741994b27bb981d8621025869a151462b5560e5e83a098100cd263", fp,
				"/var/run/tokenbroker/join/token", tokenFile,
				`opsAddress: ":9091"`, fmt.Sprintf("opsAddress: %q", ops),
			)
			cfg += "kubeconfig: " + serviceAccountKubeconfig(t, west, "tokenbroker-agent", "tokenbroker-agent") + "\n"
			cfgFile := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cfg)

			_, err := west.Client.CoreV1().Secrets("tokenbroker-agent").Get(context.Background(), "tokenbroker-agent-identity", metav1.GetOptions{})
			require.Error(t, err, "the agent starts without a certificate")
			first := watchAdded(t, west, "argo", "east")
			a := startAgent(t, cfgFile)
			written := waitTime(t, first, agentSecretsWait, "the guide's Secret argo/east")
			t.Logf("west (enrolls itself with the join token, least-privilege RBAC): first Secret written %s after the agent started",
				written.Sub(a.started).Round(time.Millisecond))
			a.waitReady(t)
			t.Logf("west agent with 1 target: RSS %.1f MiB", rssMB(t, a.proc.cmd.Process.Pid))

			id := getSecret(t, west, "tokenbroker-agent", "tokenbroker-agent-identity")
			require.Equal(t, corev1.SecretTypeTLS, id.Type)
			require.NotEmpty(t, id.Data["tls.crt"])
			require.NotEmpty(t, id.Data["tls.key"])
			require.NotEmpty(t, id.Data["ca.crt"])
			require.Equal(t, "spiffe://e2e.example/cluster/west", spiffeID(t, id.Data["tls.crt"]))

			sec := getSecret(t, west, "argo", "east")
			require.Equal(t, managedByAgent, sec.Labels[labelManagedBy])
			require.Contains(t, sec.Data, "config", "Admiralty reads the key config by default")
			require.Len(t, sec.Data, 1)

			// The Target of the guide's step 5 applies to west.
			applyYAML(t, kubectl, west, fencedBlock(t, guide, "yaml", "# west: kubectl apply -f target.yaml"))

			// The guide's check, as written.
			check := fencedBlock(t, guide, "sh", "kubectl get secret east -n argo -o jsonpath='{.data.config}' | base64 -d > east.kubeconfig")
			for _, line := range []string{
				"kubectl get secret east -n argo -o jsonpath='{.data.config}' | base64 -d > east.kubeconfig",
				"kubectl --kubeconfig east.kubeconfig auth whoami",
				"kubectl --kubeconfig east.kubeconfig -n argo get configmaps,secrets,services",
			} {
				require.Contains(t, check, line, "docs/guides/admiralty.md changed: keep this test in step")
			}
			work := t.TempDir()
			out := runShell(t, work, kubectl, west.KubeconfigPath, check)
			require.Contains(t, out, "system:serviceaccount:argo:admiralty-source")
			require.Contains(t, out, "secret/tokenbroker-lease-", "admiralty-source may list Secrets in argo")
			_, stderr, err := runErr(kubectl, "--kubeconfig", filepath.Join(work, "east.kubeconfig"), "-n", "default", "get", "configmaps")
			require.Error(t, err, "the Source binds admiralty-source in argo only")
			require.Contains(t, stderr, "forbidden")
			require.NotContains(t, a.proc.logs.String(), tokenOf(t, sec.Data["config"]), "the agent never logs a token")

			t.Run("a restarted agent adopts the credential it wrote and writes nothing", func(t *testing.T) {
				before := getSecret(t, west, "argo", "east")
				leases := countLeaseSecrets(t, east, "west")
				stopProcess(t, a.proc)
				again := startAgent(t, cfgFile)
				again.waitReady(t)
				after := getSecret(t, west, "argo", "east")
				require.Equal(t, before.ResourceVersion, after.ResourceVersion, "Admiralty restarts on every change of its Secret")
				require.Equal(t, leases, countLeaseSecrets(t, east, "west"), "no new lease")
				require.Zero(t, again.metric(t, "tokenbroker_agent_output_writes_total", "result", "written"))
				require.Zero(t, again.metric(t, "tokenbroker_agent_refresh_total", "result", "failure"))
			})
		})

		t.Run("ten targets in every output format are written, and the Argo CD and Flux Secrets work as their guides read them", func(t *testing.T) {
			t.Parallel()
			tokenFile, fp := joinToken(t, "south")
			dir := t.TempDir()
			var cfg strings.Builder
			fmt.Fprintf(&cfg, `identity:
  dir: %s
  enroll: {broker: "https://%s", caFingerprint: "%s", tokenFile: %s}
kubeconfig: %s
opsAddress: "127.0.0.1:%d"
targets:
`, filepath.Join(dir, "identity"), enrollAddr, fp, tokenFile, west.KubeconfigPath, freePort(t))
			outputs := []string{
				"secret: {namespace: argo, name: south-admiralty, format: admiralty}",
				"secret: {namespace: argocd, name: cluster-east, format: argocd, labels: {env: e2e}}",
				"secret: {namespace: flux-system, name: east-kubeconfig, format: flux}",
				"secret: {namespace: argo, name: south-kubeconfig, format: kubeconfig}",
				"file: {path: " + filepath.Join(dir, "t4.kubeconfig") + "}",
			}
			for i := 5; i < 10; i++ {
				outputs = append(outputs, fmt.Sprintf("secret: {namespace: argo, name: south-%d, format: admiralty}", i))
			}
			for i, o := range outputs {
				fmt.Fprintf(&cfg, "  - name: t%d\n    broker: https://%s\n    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 1h}\n    outputs:\n      - %s\n", i, e.api, o)
			}
			s := startAgent(t, writeFile(t, filepath.Join(dir, "south.yaml"), cfg.String()))
			ready := s.waitReady(t)
			t.Logf("south: 10 targets written %s after the agent started (enrollment included)", ready.Round(time.Millisecond))
			time.Sleep(time.Second) // let the heap settle after the burst
			t.Logf("south agent with 10 targets: RSS %.1f MiB", rssMB(t, s.proc.cmd.Process.Pid))

			argo := getSecret(t, west, "argocd", "cluster-east")
			require.Equal(t, "cluster", argo.Labels["argocd.argoproj.io/secret-type"])
			require.Equal(t, "e2e", argo.Labels["env"])
			require.Equal(t, "t1", string(argo.Data["name"]))
			require.Equal(t, east.URL, string(argo.Data["server"]))
			flux := getSecret(t, west, "flux-system", "east-kubeconfig")
			require.Equal(t, "Enabled", flux.Labels["reconcile.fluxcd.io/watch"])
			require.Contains(t, flux.Data, "value")
			plain := getSecret(t, west, "argo", "south-kubeconfig")
			require.Contains(t, plain.Data, "kubeconfig")
			st, err := os.Stat(filepath.Join(dir, "t4.kubeconfig"))
			require.NoError(t, err)
			require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

			for _, tc := range []struct{ guide, marker string }{
				{argoCDGuide, "kubectl -n argocd get secret cluster-east -o json | jq"},
				{fluxGuide, "kubectl get secret east-kubeconfig -n flux-system -o jsonpath='{.data.value}' | base64 -d > east.kubeconfig"},
			} {
				// The guide's first two lines: build the kubeconfig from the
				// Secret as the consumer reads it, then auth whoami.
				block := fencedBlock(t, readDoc(t, tc.guide), "sh", tc.marker)
				var script []string
				for _, l := range strings.Split(block, "\n") {
					script = append(script, l)
					if strings.Contains(l, "auth whoami") {
						break
					}
				}
				out := runShell(t, t.TempDir(), kubectl, west.KubeconfigPath, strings.Join(script, "\n"))
				require.Contains(t, out, "system:serviceaccount:argo:admiralty-source", "%s", tc.guide)
			}
		})

		t.Run("tokenbroker get kubeconfig writes a kubeconfig once, on the agent's code path, that kubectl uses", func(t *testing.T) {
			t.Parallel()
			kc := filepath.Join(t.TempDir(), "east.kubeconfig")
			_, stderr, err := runErr(bin, "get", "kubeconfig", "--broker", "https://"+e.api, "--identity-dir", northDir,
				"--namespace", "argo", "--service-account", "admiralty-source", "--ttl", "10m", "-o", kc)
			require.NoError(t, err, stderr)
			require.Regexp(t, `^lease [a-z2-7]{26} for argo/admiralty-source expires at `, stderr)
			st, err := os.Stat(kc)
			require.NoError(t, err)
			require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
			out := run(t, kubectl, "--kubeconfig", kc, "auth", "whoami")
			require.Contains(t, out, "system:serviceaccount:argo:admiralty-source")
			data, err := os.ReadFile(kc)
			require.NoError(t, err)
			require.NotContains(t, stderr, tokenOf(t, data), "the token goes to the file only")
		})

		t.Run("the agent renews its 10-minute client certificate and keeps working with the new one", func(t *testing.T) {
			t.Parallel()
			serial0 := northCert.SerialNumber
			var renewed *x509.Certificate
			require.Eventually(t, func() bool {
				renewed = readCert(t, filepath.Join(northDir, "tls.crt"))
				return renewed.SerialNumber.Cmp(serial0) != 0
			}, 45*time.Second, 200*time.Millisecond, "the certificate in the identity directory is replaced")
			st, err := os.Stat(filepath.Join(northDir, "tls.crt"))
			require.NoError(t, err)
			t.Logf("north renewed its certificate %.0f time(s), the last %s after the agent started (serial %x, first %x)",
				north.metric(t, "tokenbroker_agent_certificate_renewals_total", "result", "success"),
				st.ModTime().Sub(north.started).Round(100*time.Millisecond), renewed.SerialNumber, serial0)
			require.Equal(t, "spiffe://e2e.example/cluster/north", spiffeID(t, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: renewed.Raw})))
			require.GreaterOrEqual(t, north.metric(t, "tokenbroker_agent_certificate_renewals_total", "result", "success"), 1.0)
			require.Greater(t, north.metric(t, "tokenbroker_agent_certificate_expiry_seconds"), 9*60.0)

			// A refresh after the renewal went out with the new certificate
			// (the renewal closes kept-alive connections).
			require.Eventually(t, func() bool {
				logs := north.proc.logs.String()
				i := strings.Index(logs, `"msg":"client certificate renewed"`)
				return i >= 0 && strings.Contains(logs[i:], `"msg":"obtained a credential"`)
			}, 20*time.Second, 100*time.Millisecond, "a refresh follows the renewal")
			require.Zero(t, north.metric(t, "tokenbroker_agent_certificate_renewals_total", "result", "failure"))
			require.Zero(t, north.metric(t, "tokenbroker_agent_refresh_total", "result", "failure"))
			// The renewed files work with curl. (The serial is read on both
			// sides in case the agent renewed once more meanwhile.)
			before := readCert(t, filepath.Join(northDir, "tls.crt")).SerialNumber
			status, body := curlIdentity(t, e, northDir, "https://"+e.api+"/v1/whoami")
			after := readCert(t, filepath.Join(northDir, "tls.crt")).SerialNumber
			require.Equal(t, 200, status, body)
			var who apiv1.WhoAmI
			require.NoError(t, json.Unmarshal([]byte(body), &who))
			require.NotEqual(t, serial0, before)
			require.Contains(t, []string{fmt.Sprintf("%x", before), fmt.Sprintf("%x", after)},
				strings.TrimLeft(strings.ToLower(who.Certificate.SerialNumber), "0"))
		})
	})

	t.Run("with the broker stopped the agent keeps its credential, reports the failure and recovers when the broker is back", func(t *testing.T) {
		failures := north.metric(t, "tokenbroker_agent_refresh_total", "result", "failure")
		successes := north.metric(t, "tokenbroker_agent_refresh_total", "result", "success")
		stopProcess(t, e.proc)
		held := getSecret(t, west, "argo", "east-north")

		require.Eventually(t, func() bool {
			return north.metric(t, "tokenbroker_agent_refresh_total", "result", "failure") > failures
		}, 20*time.Second, 100*time.Millisecond, "the failed refresh shows in the metrics")
		now := getSecret(t, west, "argo", "east-north")
		require.Equal(t, held.ResourceVersion, now.ResourceVersion, "a failed fetch never touches the output")
		require.True(t, tokenValid(t, east, tokenOf(t, now.Data["config"])), "the credential held still works")
		status, body := north.get(t, "/healthz")
		require.Equal(t, 200, status, "the credential outlives the next retry: %s", body)
		require.Greater(t, north.metric(t, "tokenbroker_agent_credential_expiry_seconds", "target", "east"), 60.0)

		e.launch(t) // the same ports
		sec := waitSecret(t, west, "argo", "east-north", 30*time.Second, func(s *corev1.Secret) bool {
			return s.Annotations[annLeaseID] != held.Annotations[annLeaseID]
		})
		require.True(t, tokenValid(t, east, tokenOf(t, sec.Data["config"])))
		require.Greater(t, north.metric(t, "tokenbroker_agent_refresh_total", "result", "success"), successes)
		t.Logf("north: %.0f failed refreshes during the outage, then recovered", north.metric(t, "tokenbroker_agent_refresh_total", "result", "failure")-failures)
	})
}

// startTwoClusters starts east and west at the same time.
func startTwoClusters(t *testing.T) (east, west *testcluster.Cluster) {
	t.Helper()
	var wg sync.WaitGroup
	var errs [2]error
	var cs [2]*testcluster.Cluster
	for i := range cs {
		wg.Go(func() { cs[i], errs[i] = testcluster.Run(t.Context()) })
	}
	wg.Wait()
	for i, c := range cs {
		if c != nil {
			t.Cleanup(func() { require.NoError(t, c.Stop()) })
		}
		require.NoError(t, errs[i])
	}
	t.Logf("east %s and west %s ready in %s and %s", cs[0].URL, cs[1].URL,
		cs[0].StartDuration.Round(time.Millisecond), cs[1].StartDuration.Round(time.Millisecond))
	return cs[0], cs[1]
}

// agentProc is a running `tokenbroker agent`.
type agentProc struct {
	proc    *process
	ops     string
	started time.Time
}

func startAgent(t *testing.T, config string) *agentProc {
	t.Helper()
	raw, err := os.ReadFile(config)
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^opsAddress: "?([^"\s]+)"?$`).FindSubmatch(raw)
	require.NotNil(t, m, "the test's agent configs name their ops address")
	a := &agentProc{ops: string(m[1]), started: time.Now()}
	a.proc = startProcess(t, tokenbrokerBinary(t), "agent", "--config", config)
	return a
}

// waitReady waits for /readyz and returns how long after the start it
// answered 200.
func (a *agentProc) waitReady(t *testing.T) time.Duration {
	t.Helper()
	var last string
	for time.Since(a.started) < agentSecretsWait {
		select {
		case err := <-a.proc.done:
			a.proc.done <- err
			t.Fatalf("the agent exited: %v\n%s", err, a.proc.logs.String())
		default:
		}
		status, body := a.get(t, "/readyz")
		if status == 200 {
			return time.Since(a.started)
		}
		last = body
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("the agent is not ready after %s: %s\n%s", agentSecretsWait, last, a.proc.logs.String())
	return 0
}

// get returns the status and body of an operations endpoint (0 if the
// listener is not up yet).
func (a *agentProc) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + a.ops + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

var sampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$`)
var labelRE = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// metric sums the samples of name on the agent's /metrics whose labels
// include the given name/value pairs.
func (a *agentProc) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	status, body := a.get(t, "/metrics")
	require.Equal(t, 200, status, body)
	sum, found := sumSamples(t, body, name, labels...)
	require.True(t, found, "no sample of %s%v on /metrics", name, labels)
	return sum
}

// sumSamples sums the samples of name in a Prometheus text exposition
// whose labels include the given name/value pairs, and says whether there
// was one.
func sumSamples(t *testing.T, exposition, name string, labels ...string) (sum float64, found bool) {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(exposition))
	for sc.Scan() {
		m := sampleRE.FindStringSubmatch(sc.Text())
		if m == nil || m[1] != name {
			continue
		}
		have := map[string]string{}
		for _, l := range labelRE.FindAllStringSubmatch(m[2], -1) {
			have[l[1]] = l[2]
		}
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			match = match && have[labels[i]] == labels[i+1]
		}
		if match {
			v, err := strconv.ParseFloat(m[3], 64)
			require.NoError(t, err)
			sum, found = sum+v, true
		}
	}
	return sum, found
}

// stopProcess stops p with SIGTERM and waits for it; its cleanup then finds
// it stopped.
func stopProcess(t *testing.T, p *process) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-p.done:
		p.done <- err
		require.NoError(t, err, p.logs.String())
	case <-time.After(30 * time.Second):
		t.Fatal("the process did not stop within 30s of SIGTERM")
	}
}

// watchAdded starts watching for the Secret ns/name before whatever
// creates it starts, and delivers the time it was first seen.
func watchAdded(t *testing.T, c *testcluster.Cluster, ns, name string) <-chan time.Time {
	t.Helper()
	w, err := c.Client.CoreV1().Secrets(ns).Watch(t.Context(), metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	require.NoError(t, err)
	ch := make(chan time.Time, 1)
	go func() {
		defer w.Stop()
		for ev := range w.ResultChan() {
			if ev.Type == watch.Added {
				ch <- time.Now()
				return
			}
		}
	}()
	return ch
}

func waitTime(t *testing.T, ch <-chan time.Time, timeout time.Duration, what string) time.Time {
	t.Helper()
	select {
	case at := <-ch:
		return at
	case <-time.After(timeout):
		t.Fatalf("%s did not appear within %s", what, timeout)
		return time.Time{}
	}
}

func getSecret(t *testing.T, c *testcluster.Cluster, ns, name string) *corev1.Secret {
	t.Helper()
	s, err := c.Client.CoreV1().Secrets(ns).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return s
}

// waitSecret polls the Secret ns/name until ok holds.
func waitSecret(t *testing.T, c *testcluster.Cluster, ns, name string, timeout time.Duration, ok func(*corev1.Secret) bool) *corev1.Secret {
	t.Helper()
	var s *corev1.Secret
	require.Eventually(t, func() bool {
		var err error
		s, err = c.Client.CoreV1().Secrets(ns).Get(context.Background(), name, metav1.GetOptions{})
		return err == nil && ok(s)
	}, timeout, 50*time.Millisecond, "Secret %s/%s", ns, name)
	return s
}

// countLeaseSecrets counts the broker's lease Secrets of a peer in argo.
func countLeaseSecrets(t *testing.T, c *testcluster.Cluster, peer string) int {
	t.Helper()
	l, err := c.Client.CoreV1().Secrets("argo").List(context.Background(), metav1.ListOptions{LabelSelector: "tokenbroker.io/peer=" + peer})
	require.NoError(t, err)
	return len(l.Items)
}

// tokenOf returns the token of a kubeconfig's current context.
func tokenOf(t *testing.T, kubeconfig []byte) string {
	t.Helper()
	cfg, err := clientcmd.Load(kubeconfig)
	require.NoError(t, err)
	ctx := cfg.Contexts[cfg.CurrentContext]
	require.NotNil(t, ctx)
	user := cfg.AuthInfos[ctx.AuthInfo]
	require.NotNil(t, user)
	require.NotEmpty(t, user.Token)
	return user.Token
}

func readCert(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(file)
	require.NoError(t, err)
	block, _ := pem.Decode(data)
	require.NotNil(t, block, file)
	cert, err := x509.ParseCertificate(block.Bytes)
	require.NoError(t, err)
	return cert
}

func spiffeID(t *testing.T, certPEM []byte) string {
	t.Helper()
	block, _ := pem.Decode(certPEM)
	require.NotNil(t, block)
	cert, err := x509.ParseCertificate(block.Bytes)
	require.NoError(t, err)
	require.Len(t, cert.URIs, 1)
	return cert.URIs[0].String()
}

// curlIdentity calls the broker with the certificate of an identity
// directory.
func curlIdentity(t *testing.T, e *brokerEnv, dir, url string) (int, string) {
	t.Helper()
	body := filepath.Join(t.TempDir(), "body")
	code := run(t, "curl", "-sS", "--cert", filepath.Join(dir, "tls.crt"), "--key", filepath.Join(dir, "tls.key"),
		"--cacert", filepath.Join(dir, "ca.crt"), "-o", body, "-w", "%{http_code}", url)
	b, _ := os.ReadFile(body)
	status, _ := strconv.Atoi(code)
	return status, string(b)
}

// leaseIDs lists the leases of the identity in dir, as it sees them.
func leaseIDs(t *testing.T, e *brokerEnv, dir string) []string {
	t.Helper()
	status, body := curlIdentity(t, e, dir, "https://"+e.api+"/v1/leases")
	require.Equal(t, 200, status, body)
	var list apiv1.LeaseList
	require.NoError(t, json.Unmarshal([]byte(body), &list))
	ids := make([]string, 0, len(list.Items))
	for _, l := range list.Items {
		ids = append(ids, l.ID)
	}
	return ids
}

func readDoc(t *testing.T, rel string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	require.NoError(t, err)
	return string(data)
}

// fencedBlocks returns the bodies of the ```lang blocks of a Markdown
// document, each ending with a newline.
func fencedBlocks(doc, lang string) []string {
	var blocks []string
	lines := strings.Split(doc, "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```"+lang {
			continue
		}
		var body []string
		j := i + 1
		for ; j < len(lines) && strings.TrimSpace(lines[j]) != "```"; j++ {
			body = append(body, lines[j])
		}
		blocks = append(blocks, strings.Join(body, "\n")+"\n")
		i = j
	}
	return blocks
}

// fencedBlock returns the first ```lang block of a Markdown document whose
// first line starts with first.
func fencedBlock(t *testing.T, doc, lang, first string) string {
	t.Helper()
	for _, b := range fencedBlocks(doc, lang) {
		if strings.HasPrefix(b, first) {
			return b
		}
	}
	t.Fatalf("no ```%s block starting with %q: the document changed, keep the test in step", lang, first)
	return ""
}

// replaceAll replaces each old string of pairs (old, new, old, new, …) in
// s, and fails if one is missing: the document it came from changed.
func replaceAll(t *testing.T, s string, pairs ...string) string {
	t.Helper()
	for i := 0; i+1 < len(pairs); i += 2 {
		require.Contains(t, s, pairs[i], "the document changed: keep the test in step")
	}
	return strings.NewReplacer(pairs...).Replace(s)
}

func applyYAML(t *testing.T, kubectl string, c *testcluster.Cluster, doc string) {
	t.Helper()
	f := writeFile(t, filepath.Join(t.TempDir(), "objects.yaml"), doc)
	run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "apply", "-f", f)
}

// runShell runs a guide's shell lines with bash in dir, where `kubectl` is
// the test's kubectl and talks to the cluster of kubeconfig by default, and
// `tokenbroker` the binary under test.
func runShell(t *testing.T, dir, kubectl, kubeconfig, script string) string {
	t.Helper()
	cmd := exec.Command("bash", "-c", "set -euo pipefail\n"+script)
	cmd.Dir = dir
	path := filepath.Dir(kubectl) + ":" + filepath.Dir(tokenbrokerBinary(t)) + ":" + os.Getenv("PATH")
	cmd.Env = append(os.Environ(), "PATH="+path, "KUBECONFIG="+kubeconfig)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s\n%s", script, out)
	return string(out)
}

// admiraltyCRDs stand in for the CustomResourceDefinitions of Admiralty's
// chart: the same group, kinds and spec fields (pkg/apis/multicluster/
// v1alpha1 source_types.go and target_types.go), so that kubectl's strict
// field validation catches a misspelt field in the guide.
const admiraltyCRDs = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: sources.multicluster.admiralty.io
spec:
  group: multicluster.admiralty.io
  names: {kind: Source, listKind: SourceList, plural: sources, singular: source}
  scope: Namespaced
  versions:
    - name: v1alpha1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                userName: {type: string}
                serviceAccountName: {type: string}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: targets.multicluster.admiralty.io
spec:
  group: multicluster.admiralty.io
  names: {kind: Target, listKind: TargetList, plural: targets, singular: target}
  scope: Namespaced
  versions:
    - name: v1alpha1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                self: {type: boolean}
                excludedLabelsRegexp: {type: string}
                kubeconfigSecret:
                  type: object
                  required: [name]
                  properties:
                    name: {type: string}
                    key: {type: string}
                    context: {type: string}
`

// admiraltyClusterRoles stand in for the ClusterRoles of Admiralty's chart
// (release name admiralty; charts/multicluster-scheduler/templates/cr.yaml):
// the source role's rules on core resources, and the cluster summary
// viewer.
const admiraltyClusterRoles = `apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: admiralty-source
rules:
  - apiGroups: [multicluster.admiralty.io]
    resources: [podchaperons]
    verbs: [get, list, watch, create, update, delete, deletecollection, patch]
  - apiGroups: [""]
    resources: [services, secrets, configmaps]
    verbs: [get, list, watch, create, update, delete]
  - apiGroups: [""]
    resources: [pods]
    verbs: [list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: admiralty-cluster-summary-viewer
rules:
  - apiGroups: [multicluster.admiralty.io]
    resources: [clustersummaries]
    verbs: [get, list, watch]
`
