package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

var (
	imageRefOnce sync.Once
	imageRefVal  string
)

// imageRef is what `make image` tags: `make image-ref`.
func imageRef(t *testing.T) string {
	t.Helper()
	imageRefOnce.Do(func() {
		out, _, err := runErr("make", "-s", "--no-print-directory", "-C", repoRoot(t), "image-ref")
		if err == nil {
			imageRefVal = strings.TrimSpace(out)
		}
	})
	require.Regexp(t, `^[a-z0-9./-]+:v[0-9]+\.[0-9]+\.[0-9]+`, imageRefVal, "make image-ref")
	return imageRefVal
}

func newAgentHelm(t *testing.T) *helmCmd {
	t.Helper()
	h := newHelm(t)
	h.chart = filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker-agent")
	return h
}

func (h *helmCmd) renderAs(t *testing.T, release, namespace string, args ...string) []manifest {
	t.Helper()
	return splitManifests(t, h.run(t, append([]string{"template", release, h.chart, "--namespace", namespace}, args...)...))
}

// TestTheDefaultImageIsTheOneMakeImageTags checks that both charts and
// both kustomize bases deploy, by default, exactly the reference `make
// image` tags, so that an install from this commit pulls the image built
// from it.
func TestTheDefaultImageIsTheOneMakeImageTags(t *testing.T) {
	ref := imageRef(t)
	broker := newHelm(t).render(t, "--set", "pki.tlsSecret=tls")
	require.Equal(t, ref, decode[appsv1.Deployment](t, findManifest(t, broker, "Deployment", "tokenbroker")).Spec.Template.Spec.Containers[0].Image)
	agent := newAgentHelm(t).renderAs(t, "tokenbroker-agent", "tokenbroker-agent", "-f", newAgentHelm(t).values("default"))
	require.Equal(t, ref, decode[appsv1.Deployment](t, findManifest(t, agent, "Deployment", "tokenbroker-agent")).Spec.Template.Spec.Containers[0].Image)
	kubectl := kubectlBinary(t)
	for _, base := range []string{"base", "agent"} {
		docs := splitManifests(t, run(t, kubectl, "kustomize", filepath.Join(repoRoot(t), "deploy", base)))
		d := decode[appsv1.Deployment](t, manifestsOf(docs, "Deployment")[0])
		require.Equal(t, ref, d.Spec.Template.Spec.Containers[0].Image, "deploy/%s", base)
	}
}

// TestTheAgentChartDeploysWhatTheKustomizeBaseDeploys compares the agent
// chart's Deployment (default values) with deploy/agent's: the same
// container args, mounts, ports, probes, environment and security contexts
// (helm_test.go does the same for the broker's chart and deploy/base). The
// container test (image_test.go) runs the image with what the charts
// render, so every install path runs what was tested.
func TestTheAgentChartDeploysWhatTheKustomizeBaseDeploys(t *testing.T) {
	h := newAgentHelm(t)
	kDocs := splitManifests(t, run(t, kubectlBinary(t), "kustomize", filepath.Join(repoRoot(t), "deploy", "agent")))
	hDocs := h.renderAs(t, "tokenbroker-agent", "tokenbroker-agent", "-f", h.values("default"))
	k := decode[appsv1.Deployment](t, findManifest(t, kDocs, "Deployment", "tokenbroker-agent")).Spec
	c := decode[appsv1.Deployment](t, findManifest(t, hDocs, "Deployment", "tokenbroker-agent")).Spec
	require.Equal(t, k.Replicas, c.Replicas)
	require.Equal(t, k.Strategy, c.Strategy)
	kp, cp := k.Template.Spec, c.Template.Spec
	kc, cc := kp.Containers[0], cp.Containers[0]
	require.Equal(t, kc.Args, cc.Args)
	require.Equal(t, kc.VolumeMounts, cc.VolumeMounts)
	require.Equal(t, kc.Ports, cc.Ports)
	require.Equal(t, kc.LivenessProbe, cc.LivenessProbe)
	require.Equal(t, kc.ReadinessProbe, cc.ReadinessProbe)
	require.Equal(t, kc.SecurityContext, cc.SecurityContext)
	require.Equal(t, kc.Resources, cc.Resources)
	require.Equal(t, kc.Env, cc.Env)
	require.Equal(t, kp.SecurityContext, cp.SecurityContext)
	require.Equal(t, kp.AutomountServiceAccountToken, cp.AutomountServiceAccountToken)
	require.Equal(t, kp.TerminationGracePeriodSeconds, cp.TerminationGracePeriodSeconds)
	// The volumes' sources differ only in the generated ConfigMap name.
	require.Len(t, cp.Volumes, len(kp.Volumes))
	for i, kv := range kp.Volumes {
		cv := cp.Volumes[i]
		require.Equal(t, kv.Name, cv.Name)
		if kv.Secret != nil {
			require.Equal(t, kv.Secret, cv.Secret, kv.Name)
		} else {
			require.NotNil(t, cv.ConfigMap, kv.Name)
			require.Equal(t, kv.ConfigMap.DefaultMode, cv.ConfigMap.DefaultMode, kv.Name)
		}
	}
	requireHardened(t, cp)
}

// TestAgentChartRenders checks deploy/helm/tokenbroker-agent without a
// cluster: its configuration is one the agent's own loader accepts, with
// the identity Secret, the join token file and the ops port filled in; its
// RBAC is deploy/agent's, made from the outputs (get and update on each
// named Secret, create, nothing else); and a missing targets list fails
// with a clear message.
func TestAgentChartRenders(t *testing.T) {
	h := newAgentHelm(t)
	bin := tokenbrokerBinary(t)

	t.Run("the default values render deploy/agent's objects and a configuration the agent accepts", func(t *testing.T) {
		docs := h.renderAs(t, "tokenbroker-agent", "tokenbroker-agent", "-f", h.values("default"))
		require.ElementsMatch(t, []string{
			"ServiceAccount/tokenbroker-agent/tokenbroker-agent",
			"ConfigMap/tokenbroker-agent/tokenbroker-agent-config",
			"Role/tokenbroker-agent/tokenbroker-agent-identity",
			"RoleBinding/tokenbroker-agent/tokenbroker-agent-identity",
			"Role/argo/tokenbroker-agent-output",
			"RoleBinding/argo/tokenbroker-agent-output",
			"Deployment/tokenbroker-agent/tokenbroker-agent",
		}, kindNames(docs))
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "tokenbroker-agent-config"))
		file := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
		out := run(t, bin, "config", "validate", "--kind", "agent", file)
		require.Contains(t, out, "valid agent config")
		var cfg struct {
			Identity struct {
				Secret struct{ Namespace, Name string }
				Enroll struct{ TokenFile string }
			}
			OpsAddress string
		}
		require.NoError(t, yaml.Unmarshal([]byte(cm.Data["agent.yaml"]), &cfg))
		require.Equal(t, "tokenbroker-agent", cfg.Identity.Secret.Namespace)
		require.Equal(t, "tokenbroker-agent-identity", cfg.Identity.Secret.Name)
		require.Equal(t, "/var/run/tokenbroker/join/token", cfg.Identity.Enroll.TokenFile)
		require.Equal(t, ":9091", cfg.OpsAddress)

		kDocs := splitManifests(t, run(t, kubectlBinary(t), "kustomize", filepath.Join(repoRoot(t), "deploy", "agent")))
		for _, name := range []string{"tokenbroker-agent-identity", "tokenbroker-agent-output"} {
			var kr, hr rbacv1.Role
			for _, d := range manifestsOf(kDocs, "Role") {
				if d.Metadata.Name == name {
					kr = decode[rbacv1.Role](t, d)
				}
			}
			for _, d := range manifestsOf(docs, "Role") {
				if d.Metadata.Name == name {
					hr = decode[rbacv1.Role](t, d)
				}
			}
			require.Equal(t, kr.Namespace, hr.Namespace, name)
			require.Equal(t, normalizedRules(kr.Rules), normalizedRules(hr.Rules), name)
		}
	})

	t.Run("every output namespace gets a Role naming exactly its Secrets", func(t *testing.T) {
		docs := h.renderAs(t, "west", "agents", "-f", h.values("everything"))
		roles := map[string][]string{}
		for _, d := range manifestsOf(docs, "Role") {
			r := decode[rbacv1.Role](t, d)
			require.Len(t, r.Rules, 2)
			require.Equal(t, []string{"get", "update"}, r.Rules[0].Verbs)
			require.Equal(t, []string{"create"}, r.Rules[1].Verbs)
			require.Empty(t, r.Rules[1].ResourceNames)
			roles[r.Namespace] = r.Rules[0].ResourceNames
		}
		require.Equal(t, map[string][]string{
			"agents": {"west-identity"},
			"argo":   {"east", "east-argocd"},
			"kargo":  {"east"},
			"argocd": {"cluster-east"},
		}, roles)
		// Cluster-wide only what identity.trustBundleFrom reads: the
		// ClusterTrustBundles, cluster-scoped and public.
		require.Equal(t, []string{"ClusterRole/west-tokenbroker-agent-trust-bundles"}, kindNames(manifestsOf(docs, "ClusterRole")))
		ctbRole := decode[rbacv1.ClusterRole](t, findManifest(t, docs, "ClusterRole", "west-tokenbroker-agent-trust-bundles"))
		require.Equal(t, []rbacv1.PolicyRule{{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, Verbs: []string{"list"}}}, ctbRole.Rules)
		d := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "west-tokenbroker-agent"))
		ctr := d.Spec.Template.Spec.Containers[0]
		require.Equal(t, int32(9191), ctr.Ports[0].ContainerPort)
		require.Equal(t, "west-join", d.Spec.Template.Spec.Volumes[1].Secret.SecretName)
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "west-tokenbroker-agent-config"))
		require.Contains(t, cm.Data["agent.yaml"], "tokenFile: /var/run/tokenbroker/join/join-token")
		file := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
		require.Contains(t, run(t, bin, "config", "validate", "--kind", "agent", file), "valid agent config")
		require.NotEmpty(t, manifestsOf(docs, "ServiceMonitor"))
		require.NotEmpty(t, manifestsOf(docs, "PrometheusRule"))
	})

	t.Run("jwksUpload.livePods adds list and watch on Pods, cluster-wide, and nothing else", func(t *testing.T) {
		docs := h.renderAs(t, "west", "agents", "-f", h.values("everything"), "--set-json",
			`config.jwksUpload={"brokers":["https://east.example.com:8443"],"livePods":{"audiences":["tokenbroker.east"]}}`)
		require.ElementsMatch(t, []string{"ClusterRole/west-tokenbroker-agent-live-pods", "ClusterRole/west-tokenbroker-agent-trust-bundles"},
			kindNames(manifestsOf(docs, "ClusterRole")))
		role := decode[rbacv1.ClusterRole](t, findManifest(t, docs, "ClusterRole", "west-tokenbroker-agent-live-pods"))
		require.Equal(t, []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"list", "watch"}}}, role.Rules)
		binding := decode[rbacv1.ClusterRoleBinding](t, findManifest(t, docs, "ClusterRoleBinding", "west-tokenbroker-agent-live-pods"))
		require.Equal(t, []rbacv1.Subject{{Kind: "ServiceAccount", Name: "west-tokenbroker-agent", Namespace: "agents"}}, binding.Subjects)
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "west-tokenbroker-agent-config"))
		file := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
		require.Contains(t, run(t, bin, "config", "validate", "--kind", "agent", file), "valid agent config")
	})

	t.Run("podSigner adds the signer's rules, for its signer name alone, and needs no target", func(t *testing.T) {
		docs := h.renderAs(t, "west", "agents", "-f", h.values("default"), "--set-json", `config.targets=[]`,
			"--set-json", `config.identity={"renewBroker":"https://east.example.com:8443"}`,
			"--set-json", `config.podSigner={"signerName":"tokenbroker.io/workloads"}`)
		require.Equal(t, []string{"ClusterRole/west-tokenbroker-agent-pod-signer"}, kindNames(manifestsOf(docs, "ClusterRole")))
		role := decode[rbacv1.ClusterRole](t, findManifest(t, docs, "ClusterRole", "west-tokenbroker-agent-pod-signer"))
		require.Equal(t, []rbacv1.PolicyRule{
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"podcertificaterequests"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"podcertificaterequests/status"}, Verbs: []string{"update"}},
			{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, ResourceNames: []string{"tokenbroker.io/workloads"}, Verbs: []string{"sign"}},
			{APIGroups: []string{""}, Resources: []string{"pods", "serviceaccounts"}, Verbs: []string{"get"}},
		}, role.Rules)
		binding := decode[rbacv1.ClusterRoleBinding](t, findManifest(t, docs, "ClusterRoleBinding", "west-tokenbroker-agent-pod-signer"))
		require.Equal(t, []rbacv1.Subject{{Kind: "ServiceAccount", Name: "west-tokenbroker-agent", Namespace: "agents"}}, binding.Subjects)
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "west-tokenbroker-agent-config"))
		file := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
		require.Contains(t, run(t, bin, "config", "validate", "--kind", "agent", file), "valid agent config")
	})

	t.Run("podCertificate makes the agent's identity its Pod's certificate: no identity Secret, no join token", func(t *testing.T) {
		docs := h.renderAs(t, "tokenbroker-agent-pod", "agents", "-f", h.values("default"), "--set-json", `config.identity=null`,
			"--set", "podCertificate.signerName=tokenbroker.io/workloads", "--set", "podCertificate.caConfigMap=broker-ca")
		require.ElementsMatch(t, []string{
			"ServiceAccount/agents/tokenbroker-agent-pod",
			"ConfigMap/agents/tokenbroker-agent-pod-config",
			"Role/argo/tokenbroker-agent-pod-output",
			"RoleBinding/argo/tokenbroker-agent-pod-output",
			"Deployment/agents/tokenbroker-agent-pod",
		}, kindNames(docs), "no Role on an identity Secret: there is none")
		sa := decode[corev1.ServiceAccount](t, findManifest(t, docs, "ServiceAccount", "tokenbroker-agent-pod"))
		require.Equal(t, "true", sa.Labels["tokenbroker.io/pod-certificates"], "the signer signs for labelled ServiceAccounts only")
		d := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "tokenbroker-agent-pod"))
		var vol *corev1.Volume
		for i, v := range d.Spec.Template.Spec.Volumes {
			require.NotEqual(t, "join", v.Name, "no join token")
			if v.Name == "pod-identity" {
				vol = &d.Spec.Template.Spec.Volumes[i]
			}
		}
		require.NotNil(t, vol)
		require.Equal(t, &corev1.PodCertificateProjection{SignerName: "tokenbroker.io/workloads", KeyType: "ECDSAP256",
			MaxExpirationSeconds: ptrTo(int32(86400)), CertificateChainPath: "tls.crt", KeyPath: "tls.key"}, vol.Projected.Sources[0].PodCertificate)
		require.Equal(t, "broker-ca", vol.Projected.Sources[1].ConfigMap.Name)
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "tokenbroker-agent-pod-config"))
		require.Contains(t, cm.Data["agent.yaml"], "podCertificate:\n    dir: /var/run/tokenbroker/pod-identity")
		file := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
		require.Contains(t, run(t, bin, "config", "validate", "--kind", "agent", file), "valid agent config")

		_, stderr, err := h.runErr("template", "x", h.chart, "-f", h.values("default"), "--set", "podCertificate.signerName=tokenbroker.io/workloads",
			"--set", "podCertificate.caConfigMap=broker-ca")
		require.Error(t, err)
		require.Contains(t, stderr, "config.identity takes only trustBundleFrom then", "no join token, no identity store")
		_, stderr, err = h.runErr("template", "x", h.chart, "-f", h.values("default"), "--set-json", `config.identity=null`,
			"--set", "podCertificate.signerName=tokenbroker.io/workloads")
		require.Error(t, err)
		require.Contains(t, stderr, "podCertificate.caConfigMap is required")
		_, stderr, err = h.runErr("template", "x", h.chart, "-f", h.values("default"), "--set", "podCertificate.signerName=tokenbroker.io/workloads",
			"--set", "podCertificate.caConfigMap=broker-ca", "--set-json", `config.podSigner={"signerName":"tokenbroker.io/workloads"}`, "--set-json", `config.identity=null`)
		require.Error(t, err)
		require.Contains(t, stderr, "exclude each other")
	})

	t.Run("without targets, rendering fails and says what is missing", func(t *testing.T) {
		_, stderr, err := h.runErr("template", "tokenbroker-agent", h.chart)
		require.Error(t, err)
		require.Contains(t, stderr, "config.targets is required")
	})
}

// ruleGroups is the spec of a rendered PrometheusRule.
type ruleGroups struct {
	Spec struct {
		Groups []json.RawMessage `json:"groups"`
	} `json:"spec"`
}

// TestTheChartsShipTheDocumentedAlertsAndADashboardOverRealMetrics checks
// the optional monitoring objects: each chart's PrometheusRule holds its
// group of the example in docs/operations.md, unchanged but for the job of
// the chart's ServiceMonitor (that example is itself checked against the
// metrics the code registers); the Grafana dashboard's every query parses
// with Prometheus's parser and selects only documented metrics with labels
// they have.
func TestTheChartsShipTheDocumentedAlertsAndADashboardOverRealMetrics(t *testing.T) {
	var doc ruleGroups
	require.NoError(t, yaml.Unmarshal([]byte(fencedBlock(t, readDoc(t, "docs/operations.md"), "yaml", "apiVersion: monitoring.coreos.com/v1")), &doc))
	require.Len(t, doc.Spec.Groups, 2)
	groupJSON := func(raw json.RawMessage) string {
		var v any
		require.NoError(t, json.Unmarshal(raw, &v))
		b, err := json.Marshal(v)
		require.NoError(t, err)
		return string(b)
	}

	bh := newHelm(t)
	broker := bh.renderAs(t, "prod", "tokenbroker", "-f", bh.values("everything"))
	var br ruleGroups
	require.NoError(t, yaml.Unmarshal(findManifest(t, broker, "PrometheusRule", "prod-tokenbroker").raw, &br))
	require.Len(t, br.Spec.Groups, 1)
	want := strings.ReplaceAll(groupJSON(doc.Spec.Groups[0]), `job=\"tokenbroker-metrics\"`, `job=\"prod-tokenbroker-metrics\"`)
	require.Equal(t, want, groupJSON(br.Spec.Groups[0]), "the broker chart's alerts are docs/operations.md's, selecting its metrics Service")
	require.NotEmpty(t, findManifest(t, broker, "Service", "prod-tokenbroker-metrics"))

	ah := newAgentHelm(t)
	agent := ah.renderAs(t, "tokenbroker-agent", "tokenbroker-agent", "-f", ah.values("everything"))
	var ar ruleGroups
	require.NoError(t, yaml.Unmarshal(findManifest(t, agent, "PrometheusRule", "tokenbroker-agent").raw, &ar))
	require.Equal(t, []string{groupJSON(doc.Spec.Groups[1])}, []string{groupJSON(ar.Spec.Groups[0])}, "the agent chart's alerts are docs/operations.md's")

	for _, docs := range [][]manifest{newHelm(t).render(t, "--set", "pki.tlsSecret=tls"), ah.renderAs(t, "a", "b", "-f", ah.values("default"))} {
		require.Empty(t, manifestsOf(docs, "PrometheusRule"), "off by default")
	}
	require.Empty(t, manifestsOf(newHelm(t).render(t, "--set", "pki.tlsSecret=tls"), "ConfigMap")[1:], "no dashboard by default")

	cm := decode[corev1.ConfigMap](t, findManifest(t, broker, "ConfigMap", "prod-tokenbroker-dashboard"))
	require.Equal(t, "monitoring", cm.Namespace)
	require.Equal(t, "1", cm.Labels["grafana_dashboard"])
	var dash struct {
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal([]byte(cm.Data["tokenbroker.json"]), &dash))
	fromFile, err := os.ReadFile(filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker", "files", "dashboard.json"))
	require.NoError(t, err)
	require.JSONEq(t, string(fromFile), cm.Data["tokenbroker.json"])
	var names, exprs []string
	metrics := map[string]bool{}
	for _, p := range dash.Panels {
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			// Grafana's variables, as Grafana substitutes them.
			e := strings.NewReplacer("$__rate_interval", "1m", "$job", ".+").Replace(tg.Expr)
			require.NotContains(t, e, "$", "%s: an unknown variable", p.Title)
			names = append(names, p.Title)
			exprs = append(exprs, e)
		}
	}
	documented := documentedMetrics(t)
	requireQueriesOverDocumentedMetrics(t, documented, names, exprs)
	for _, res := range promqlCheck(t, exprs) {
		for _, s := range res.Selectors {
			metrics[strings.TrimSuffix(s.Metric, "_bucket")] = true
		}
	}
	var covered []string
	for m := range metrics {
		if strings.HasPrefix(m, "tokenbroker_") {
			covered = append(covered, m)
		}
	}
	slices.Sort(covered)
	require.GreaterOrEqual(t, len(covered), 15, "the dashboard shows most of the broker's metrics: %v", covered)
	t.Logf("%d panels, %d queries over %d metrics", len(dash.Panels), len(exprs), len(covered))
}

// TestAgentChartAgainstAPIServer checks the agent's chart against a real
// API server: with the defaults and with every option on, every object is
// accepted in a server-side dry run with the namespace's "restricted" Pod
// Security level in force, and `helm install` and `helm uninstall` work.
func TestAgentChartAgainstAPIServer(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	h := newAgentHelm(t)
	kubectl := kubectlBinary(t)
	admin := []string{"--kubeconfig", c.KubeconfigPath}
	applyChartPrerequisites(t, kubectl, c, "tokenbroker-agent", "argo", "argocd", "kargo")

	for _, values := range []string{"default", "everything"} {
		out := h.run(t, "template", "tokenbroker-agent", h.chart, "--namespace", "tokenbroker-agent", "-f", h.values(values))
		file := writeFile(t, filepath.Join(t.TempDir(), values+".yaml"), out)
		stdout, stderr, err := runErr(kubectl, append(admin, "apply", "--dry-run=server", "-f", file, "-o", "name")...)
		require.NoError(t, err, "%s values\nstdout: %s\nstderr: %s", values, stdout, stderr)
		require.NotContains(t, stderr, "Warning", "%s values: the Deployment must meet the restricted Pod Security Standard", values)
		require.Contains(t, stdout, "deployment.apps/tokenbroker-agent")
	}

	out := h.run(t, append(admin, "install", "tokenbroker-agent", h.chart, "-n", "tokenbroker-agent", "-f", h.values("default"),
		"--set-json", `config.jwksUpload={"brokers":["https://east.example.com:8443"],"livePods":{"audiences":["tokenbroker.east"]}}`)...)
	require.Contains(t, out, "STATUS: deployed")
	// jwksUpload.livePods: the API server lets the agent list and watch
	// the Pods of every namespace.
	user, groups := testcluster.ServiceAccountUser("tokenbroker-agent", "tokenbroker-agent")
	require.NoError(t, testcluster.WaitAllowed(context.Background(), c.Client, user, groups,
		authzv1.ResourceAttributes{Verb: "list", Resource: "pods"}, authzv1.ResourceAttributes{Verb: "watch", Resource: "pods"}))
	require.Contains(t, out, "delete that Secret after the first start", "NOTES.txt says what to do with the join token")
	_, err := c.Client.RbacV1().Roles("argo").Get(context.Background(), "tokenbroker-agent-output", metav1.GetOptions{})
	require.NoError(t, err)
	h.run(t, append(admin, "uninstall", "tokenbroker-agent", "-n", "tokenbroker-agent")...)
	_, err = c.Client.RbacV1().Roles("argo").Get(context.Background(), "tokenbroker-agent-output", metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "uninstall removes the Roles in the output namespaces: %v", err)
}

// TestTheChartsClientCertificateObjectsAreTheComponents holds the broker
// chart's clientCertificates objects to deploy/components/client-certificates:
// the same CSR rules, bind on exactly the roles the policy's
// clientCertificate grants name, the same admission policy for the
// release's ServiceAccount, and the --credentials flag; none of it by
// default.
func TestTheChartsClientCertificateObjectsAreTheComponents(t *testing.T) {
	h := newHelm(t)
	require.Empty(t, manifestsOf(h.render(t, "--set", "pki.tlsSecret=tls"), "ValidatingAdmissionPolicy"), "off by default")

	overlay := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(overlay, filepath.Join(repoRoot(t), p))
		require.NoError(t, err)
		return r
	}
	writeFile(t, filepath.Join(overlay, "kustomization.yaml"), "resources: ["+rel("deploy/base")+"]\ncomponents: ["+rel("deploy/components/client-certificates")+"]\n")
	kDocs := splitManifests(t, run(t, kubectlBinary(t), "kustomize", overlay))
	values := writeFile(t, filepath.Join(t.TempDir(), "values.yaml"), `pki: {tlsSecret: tls}
clientCertificates: {enabled: true}
policy:
  peers:
    - name: west
      identity: spiffe://oc.example/cluster/west
      grants:
        - {namespaces: [argo], credential: clientCertificate, clusterRole: view}
`)
	hDocs := h.render(t, "-f", values)
	for _, name := range []string{"tokenbroker-csr", "tokenbroker-bind"} {
		k := decode[rbacv1.ClusterRole](t, findManifest(t, kDocs, "ClusterRole", name))
		c := decode[rbacv1.ClusterRole](t, findManifest(t, hDocs, "ClusterRole", name))
		require.Equal(t, normalizedRules(k.Rules), normalizedRules(c.Rules), name)
	}
	type vap struct {
		Spec struct {
			MatchConditions []struct{ Name, Expression string }    `json:"matchConditions"`
			Validations     []struct{ Expression, Message string } `json:"validations"`
			FailurePolicy   string                                 `json:"failurePolicy"`
		} `json:"spec"`
	}
	var kv, cv vap
	require.NoError(t, yaml.Unmarshal(findManifest(t, kDocs, "ValidatingAdmissionPolicy", "tokenbroker-approves-only-its-own-csrs").raw, &kv))
	require.NoError(t, yaml.Unmarshal(findManifest(t, hDocs, "ValidatingAdmissionPolicy", "tokenbroker-approves-only-its-own-csrs").raw, &cv))
	require.Equal(t, kv, cv)
	require.Equal(t, `request.userInfo.username == "system:serviceaccount:tokenbroker:tokenbroker"`, cv.Spec.MatchConditions[0].Expression)

	kd := decode[appsv1.Deployment](t, findManifest(t, kDocs, "Deployment", "tokenbroker"))
	cd := decode[appsv1.Deployment](t, findManifest(t, hDocs, "Deployment", "tokenbroker"))
	require.Contains(t, kd.Spec.Template.Spec.Containers[0].Args, "--credentials=token,clientCertificate")
	require.Contains(t, cd.Spec.Template.Spec.Containers[0].Args, "--credentials=token,clientCertificate")
}

// TestTheChartsClusterTrustBundleRBACIsTheComponents holds the broker
// chart's clusterTrustBundle objects to deploy/components/cluster-trust-bundle:
// create on clustertrustbundles, get and update on exactly the broker's
// bundle, attest on exactly its signer, nothing else; the signer in the
// flag; no signer by default in either.
func TestTheChartsClusterTrustBundleRBACIsTheComponents(t *testing.T) {
	h := newHelm(t)
	require.NotContains(t, kindNames(manifestsOf(h.render(t, "--set", "pki.tlsSecret=tls"), "ClusterRole")), "ClusterRole/tokenbroker-trust-bundle", "off by default")

	overlay := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(overlay, filepath.Join(repoRoot(t), p))
		require.NoError(t, err)
		return r
	}
	writeFile(t, filepath.Join(overlay, "kustomization.yaml"), "resources: ["+rel("deploy/base")+"]\ncomponents: ["+rel("deploy/components/cluster-trust-bundle")+"]\n")
	// The component chooses no signer: without the overlay's ConfigMap,
	// kustomize fails.
	out, err := exec.Command(kubectlBinary(t), "kustomize", overlay).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "tokenbroker-trust-bundle-signer")

	writeFile(t, filepath.Join(overlay, "signer.yaml"), `apiVersion: v1
kind: ConfigMap
metadata:
  name: tokenbroker-trust-bundle-signer
  annotations: {config.kubernetes.io/local-config: "true"}
data:
  signerName: tokenbroker.io/east
`)
	writeFile(t, filepath.Join(overlay, "kustomization.yaml"), "resources: ["+rel("deploy/base")+", signer.yaml]\ncomponents: ["+rel("deploy/components/cluster-trust-bundle")+"]\n")
	kDocs := splitManifests(t, run(t, kubectlBinary(t), "kustomize", overlay))
	require.NotContains(t, kindNames(manifestsOf(kDocs, "ConfigMap")), "ConfigMap/tokenbroker-trust-bundle-signer", "the signer ConfigMap is kustomize's only")
	hDocs := h.render(t, "--set", "pki.tlsSecret=tls", "--set", "clusterTrustBundle.signerName=tokenbroker.io/east")
	want := normalizedRules([]rbacv1.PolicyRule{
		{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, Verbs: []string{"create"}},
		{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, ResourceNames: []string{"tokenbroker.io:east:trust-bundle"}, Verbs: []string{"get", "update"}},
		{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, ResourceNames: []string{"tokenbroker.io/east"}, Verbs: []string{"attest"}},
	})
	k := decode[rbacv1.ClusterRole](t, findManifest(t, kDocs, "ClusterRole", "tokenbroker-trust-bundle"))
	c := decode[rbacv1.ClusterRole](t, findManifest(t, hDocs, "ClusterRole", "tokenbroker-trust-bundle"))
	require.Equal(t, want, normalizedRules(k.Rules))
	require.Equal(t, want, normalizedRules(c.Rules))

	kd := decode[appsv1.Deployment](t, findManifest(t, kDocs, "Deployment", "tokenbroker"))
	require.Contains(t, kd.Spec.Template.Spec.Containers[0].Env, corev1.EnvVar{Name: "TOKENBROKER_PUBLISH_CLUSTER_TRUST_BUNDLE", Value: "tokenbroker.io/east"})
	cd := decode[appsv1.Deployment](t, findManifest(t, hDocs, "Deployment", "tokenbroker"))
	require.Contains(t, cd.Spec.Template.Spec.Containers[0].Args, "--publish-cluster-trust-bundle=tokenbroker.io/east")
}

// TestTheChartsLeaseAdmissionPolicyIsTheComponents holds the broker chart's
// leaseAdmissionPolicy to deploy/components/lease-admission-policy: the
// same match rules and validations, for the release's ServiceAccount; off
// by default. test/integration applies the component to a real API server.
func TestTheChartsLeaseAdmissionPolicyIsTheComponents(t *testing.T) {
	h := newHelm(t)
	require.Empty(t, manifestsOf(h.render(t, "--set", "pki.tlsSecret=tls"), "ValidatingAdmissionPolicy"), "off by default")

	overlay := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(overlay, filepath.Join(repoRoot(t), p))
		require.NoError(t, err)
		return r
	}
	writeFile(t, filepath.Join(overlay, "kustomization.yaml"), "resources: ["+rel("deploy/base")+"]\ncomponents: ["+rel("deploy/components/lease-admission-policy")+"]\n")
	kDocs := splitManifests(t, run(t, kubectlBinary(t), "kustomize", overlay))
	hDocs := h.render(t, "--set", "pki.tlsSecret=tls", "--set", "leaseAdmissionPolicy.enabled=true")
	var kv, cv admissionregistrationv1.ValidatingAdmissionPolicy
	require.NoError(t, yaml.Unmarshal(findManifest(t, kDocs, "ValidatingAdmissionPolicy", "tokenbroker-reserves-lease-secrets").raw, &kv))
	require.NoError(t, yaml.Unmarshal(findManifest(t, hDocs, "ValidatingAdmissionPolicy", "tokenbroker-reserves-lease-secrets").raw, &cv))
	require.Equal(t, kv.Spec, cv.Spec)
	require.Equal(t, `request.userInfo.username != "system:serviceaccount:tokenbroker:tokenbroker"`, cv.Spec.MatchConditions[0].Expression)
	var kb, cb admissionregistrationv1.ValidatingAdmissionPolicyBinding
	require.NoError(t, yaml.Unmarshal(findManifest(t, kDocs, "ValidatingAdmissionPolicyBinding", "tokenbroker-reserves-lease-secrets").raw, &kb))
	require.NoError(t, yaml.Unmarshal(findManifest(t, hDocs, "ValidatingAdmissionPolicyBinding", "tokenbroker-reserves-lease-secrets").raw, &cb))
	require.Equal(t, kb.Spec, cb.Spec)
}
