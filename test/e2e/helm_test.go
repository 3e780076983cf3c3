package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// helmVersion is the helm the Makefile pins (`make helm`).
const helmVersion = "v3.19.5"

var helmBuild sync.Mutex

// helmBinary returns bin/helm ($TOKENBROKER_BIN_DIR/helm), building the
// pinned helm from the Go module proxy if it is missing, as `make helm`
// does. A present binary is trusted, as kubectlBinary trusts kubectl: the
// Makefile replaces a helm of another version.
func helmBinary(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(testcluster.BinDirEnv)
	if dir == "" {
		dir = filepath.Join(repoRoot(t), "bin")
	}
	dir, err := filepath.Abs(dir)
	require.NoError(t, err)
	p := filepath.Join(dir, "helm")
	helmBuild.Lock()
	defer helmBuild.Unlock()
	if _, err := os.Stat(p); err != nil {
		cmd := exec.Command("go", "install", "-ldflags", "-X helm.sh/helm/v3/internal/version.version="+helmVersion, "helm.sh/helm/v3/cmd/helm@"+helmVersion)
		cmd.Env = append(os.Environ(), "GOBIN="+dir)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
	}
	return p
}

// helmCmd runs helm with its cache, configuration and data in a temporary
// directory, so that a test never reads or writes the user's.
type helmCmd struct {
	bin   string
	home  string
	chart string
}

func newHelm(t *testing.T) *helmCmd {
	t.Helper()
	return &helmCmd{bin: helmBinary(t), home: t.TempDir(), chart: filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker")}
}

func (h *helmCmd) runErr(args ...string) (string, string, error) {
	cmd := exec.Command(h.bin, args...)
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(h.home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(h.home, "config"),
		"HELM_DATA_HOME="+filepath.Join(h.home, "data"),
	)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

func (h *helmCmd) run(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, err := h.runErr(args...)
	require.NoError(t, err, "helm %s\nstdout: %s\nstderr: %s", strings.Join(args, " "), out, errOut)
	return out
}

// values returns the path of a values file in the chart's ci/ directory.
func (h *helmCmd) values(name string) string {
	return filepath.Join(h.chart, "ci", name+"-values.yaml")
}

// template renders the chart as the release "tokenbroker" in the namespace
// tokenbroker, the names deploy/base uses.
func (h *helmCmd) template(t *testing.T, args ...string) string {
	t.Helper()
	return h.run(t, append([]string{"template", "tokenbroker", h.chart, "--namespace", "tokenbroker"}, args...)...)
}

func (h *helmCmd) render(t *testing.T, args ...string) []manifest {
	t.Helper()
	return splitManifests(t, h.template(t, args...))
}

// decode decodes a rendered object strictly: a field the Kubernetes type
// does not have (a typo in a template) fails the test.
func decode[T any](t *testing.T, m manifest) T {
	t.Helper()
	var v T
	require.NoError(t, yaml.UnmarshalStrict(m.raw, &v), string(m.raw))
	return v
}

func kindNames(docs []manifest) []string {
	var out []string
	for _, d := range docs {
		name := d.Kind + "/" + d.Metadata.Name
		if d.Metadata.Namespace != "" {
			name = d.Kind + "/" + d.Metadata.Namespace + "/" + d.Metadata.Name
		}
		out = append(out, name)
	}
	return out
}

func manifestsOf(docs []manifest, kind string) []manifest {
	var out []manifest
	for _, d := range docs {
		if d.Kind == kind {
			out = append(out, d)
		}
	}
	return out
}

// serviceMonitor is the part of monitoring.coreos.com/v1 ServiceMonitor the
// chart writes.
type serviceMonitor struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Selector  metav1.LabelSelector `json:"selector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Scheme        string `json:"scheme"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// normalizedRules sorts the verbs, resources and rules, so that two rule
// lists compare equal when they grant the same.
func normalizedRules(rules []rbacv1.PolicyRule) []rbacv1.PolicyRule {
	out := make([]rbacv1.PolicyRule, len(rules))
	for i, r := range rules {
		r = *r.DeepCopy()
		for _, s := range [][]string{r.APIGroups, r.Resources, r.Verbs, r.ResourceNames} {
			slices.Sort(s)
		}
		out[i] = r
	}
	slices.SortFunc(out, func(a, b rbacv1.PolicyRule) int {
		return strings.Compare(strings.Join(a.Resources, ",")+"|"+strings.Join(a.ResourceNames, ","), strings.Join(b.Resources, ",")+"|"+strings.Join(b.ResourceNames, ","))
	})
	return out
}

// requireKnownServeFlags checks that a container's args are `serve`
// followed by flags that `tokenbroker serve --help` lists, with the
// required ones among them.
func requireKnownServeFlags(t *testing.T, args []string, help string) {
	t.Helper()
	require.NotEmpty(t, args)
	require.Equal(t, "serve", args[0])
	for _, a := range args[1:] {
		name, _, _ := strings.Cut(a, "=")
		require.Regexp(t, `(?m)^\s+`+regexp.QuoteMeta(name)+`\s`, help, "unknown flag %s", name)
	}
	for _, required := range []string{"--tls-cert-file", "--tls-key-file", "--client-ca-file", "--policy-file"} {
		require.True(t, slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, required+"=") }), "missing %s", required)
	}
}

// TestHelmChartRenders checks what deploy/helm/tokenbroker renders, without
// a cluster: helm lint, the objects and hardening of deploy/base (RBAC rules
// and security contexts compared with `kubectl kustomize deploy/base`, so
// the two install paths cannot drift), every Deployment arg a flag
// `tokenbroker serve` knows, the optional objects, the policy round trip,
// and clear failures for missing or contradictory values.
func TestHelmChartRenders(t *testing.T) {
	t.Parallel()
	h := newHelm(t)
	kubectl := kubectlBinary(t)
	base := splitManifests(t, run(t, kubectl, "kustomize", filepath.Join(repoRoot(t), "deploy", "base")))
	defaults := h.render(t, "-f", h.values("default"))
	everything := h.render(t, "-f", h.values("everything"))
	help := run(t, tokenbrokerBinary(t), "serve", "--help")

	t.Run("helm lint --strict passes with the defaults and with every ci values file", func(t *testing.T) {
		h.run(t, "lint", "--strict", h.chart)
		files, err := filepath.Glob(filepath.Join(h.chart, "ci", "*-values.yaml"))
		require.NoError(t, err)
		require.Len(t, files, 2)
		for _, f := range files {
			h.run(t, "lint", "--strict", h.chart, "-f", f)
		}
	})

	t.Run("without pki.tlsSecret rendering fails and says what to set", func(t *testing.T) {
		_, stderr, err := h.runErr("template", "tokenbroker", h.chart)
		require.Error(t, err)
		require.Contains(t, stderr, "pki.tlsSecret is required: the name of a kubernetes.io/tls Secret in the release namespace with tls.crt, tls.key and ca.crt")
	})

	t.Run("contradictory or mistyped values fail rendering with a message naming the value", func(t *testing.T) {
		for _, tc := range []struct {
			set  []string
			want string
		}{
			{[]string{"enrollment.enabled=true"}, "enrollment.caSecret is required when enrollment.enabled or gateway.enabled is true"},
			{[]string{"enrollment.enabled=true", "enrollment.caSecret=ca", "enrollment.port=9090"}, "enrollment.port must differ from containerPorts.https"},
			{[]string{"containerPorts.ops=8443"}, "containerPorts.https and containerPorts.ops must differ"},
			{[]string{"pki.clientCA.secret=a", "pki.clientCA.configMap=b"}, "pki.clientCA: set secret or configMap, not both"},
			{[]string{"audit.log=off"}, "audit.log: audit cannot be turned off"},
			{[]string{"serviceAccount.create=false"}, "serviceAccount.name is required when serviceAccount.create is false"},
			{[]string{"replicaCount=two"}, "at '/replicaCount': got string, want integer"},
			{[]string{"policy.peerz=x"}, "at '/policy': additional properties 'peerz' not allowed"},
			{[]string{"extraArgs={gc-interval=1s}"}, "at '/extraArgs/0'"},
		} {
			args := []string{"template", "tokenbroker", h.chart, "--set", "pki.tlsSecret=tls"}
			for _, s := range tc.set {
				args = append(args, "--set", s)
			}
			_, stderr, err := h.runErr(args...)
			require.Error(t, err, "%v", tc.set)
			require.Contains(t, stderr, tc.want, "%v", tc.set)
		}
	})

	t.Run("the defaults install deploy/base's objects under the same names, less the Namespace, plus a PodDisruptionBudget", func(t *testing.T) {
		var want []string
		for _, name := range kindNames(base) {
			if strings.HasPrefix(name, "Namespace/") {
				continue
			}
			// kustomize's configMapGenerator adds a content hash.
			want = append(want, regexp.MustCompile(`^(ConfigMap/tokenbroker/tokenbroker-policy)-[a-z0-9]+$`).ReplaceAllString(name, "$1"))
		}
		want = append(want, "PodDisruptionBudget/tokenbroker/tokenbroker")
		require.ElementsMatch(t, want, kindNames(defaults))
	})

	t.Run("the RBAC rules and bindings equal deploy/base's", func(t *testing.T) {
		for _, kind := range []string{"ClusterRole", "Role"} {
			for _, docs := range [][]manifest{defaults, everything} {
				var chartRules, baseRules []rbacv1.PolicyRule
				if kind == "ClusterRole" {
					chartRules = decode[rbacv1.ClusterRole](t, findManifest(t, docs, kind, "tokenbroker-issue")).Rules
					baseRules = decode[rbacv1.ClusterRole](t, findManifest(t, base, kind, "tokenbroker-issue")).Rules
					require.Equal(t,
						normalizedRules(decode[rbacv1.ClusterRole](t, findManifest(t, base, kind, "tokenbroker-namespaces")).Rules),
						normalizedRules(decode[rbacv1.ClusterRole](t, findManifest(t, docs, kind, "tokenbroker-namespaces")).Rules))
				} else {
					chartRules = decode[rbacv1.Role](t, findManifest(t, docs, kind, "tokenbroker-self")).Rules
					baseRules = decode[rbacv1.Role](t, findManifest(t, base, kind, "tokenbroker-self")).Rules
				}
				require.NotEmpty(t, baseRules)
				require.Equal(t, normalizedRules(baseRules), normalizedRules(chartRules), kind)
			}
		}
		baseCRB := decode[rbacv1.ClusterRoleBinding](t, findManifest(t, base, "ClusterRoleBinding", "tokenbroker-issue"))
		chartCRB := decode[rbacv1.ClusterRoleBinding](t, findManifest(t, defaults, "ClusterRoleBinding", "tokenbroker-issue"))
		require.Equal(t, baseCRB.RoleRef, chartCRB.RoleRef)
		require.Equal(t, baseCRB.Subjects, chartCRB.Subjects)
		baseRB := decode[rbacv1.RoleBinding](t, findManifest(t, base, "RoleBinding", "tokenbroker-self"))
		chartRB := decode[rbacv1.RoleBinding](t, findManifest(t, defaults, "RoleBinding", "tokenbroker-self"))
		require.Equal(t, baseRB.RoleRef, chartRB.RoleRef)
		require.Equal(t, baseRB.Subjects, chartRB.Subjects)
		require.Equal(t, "tokenbroker", chartRB.Namespace)
	})

	t.Run("rbac.namespaces binds tokenbroker-issue with RoleBindings in just those namespaces and no ClusterRoleBinding", func(t *testing.T) {
		// The one cluster-wide binding is the CSR permission, which cannot
		// be namespaced (CSRs are cluster-scoped).
		// So is the namespace cache's list and watch (namespaces are
		// cluster-scoped too).
		require.ElementsMatch(t, []string{"ClusterRoleBinding/tokenbroker-csr", "ClusterRoleBinding/tokenbroker-namespaces", "ClusterRoleBinding/tokenbroker-trust-bundle"}, kindNames(manifestsOf(everything, "ClusterRoleBinding")))
		baseCRB := decode[rbacv1.ClusterRoleBinding](t, findManifest(t, base, "ClusterRoleBinding", "tokenbroker-issue"))
		var issueNamespaces, bindNamespaces []string
		for _, m := range manifestsOf(everything, "RoleBinding") {
			rb := decode[rbacv1.RoleBinding](t, m)
			if rb.Name == "tokenbroker-self" {
				require.Equal(t, "tokenbroker", rb.Namespace)
				continue
			}
			if rb.Name == "tokenbroker-bind" {
				bindNamespaces = append(bindNamespaces, rb.Namespace)
				continue
			}
			require.Equal(t, "tokenbroker-issue", rb.Name)
			require.Equal(t, baseCRB.RoleRef, rb.RoleRef, "the ClusterRole is reused as a template")
			require.Equal(t, baseCRB.Subjects, rb.Subjects)
			issueNamespaces = append(issueNamespaces, rb.Namespace)
		}
		require.ElementsMatch(t, []string{"argo", "flux"}, issueNamespaces)
		require.ElementsMatch(t, []string{"argo", "flux"}, bindNamespaces, "binding roles is scoped alike")
	})

	t.Run("the Deployment has deploy/base's hardening, probes, ports, resources and args", func(t *testing.T) {
		bd := decode[appsv1.Deployment](t, findManifest(t, base, "Deployment", "tokenbroker"))
		cd := decode[appsv1.Deployment](t, findManifest(t, defaults, "Deployment", "tokenbroker"))
		bp, cp := bd.Spec.Template.Spec, cd.Spec.Template.Spec
		require.Equal(t, bd.Spec.Replicas, cd.Spec.Replicas)
		require.Equal(t, bp.SecurityContext, cp.SecurityContext)
		require.Equal(t, bp.ServiceAccountName, cp.ServiceAccountName)
		require.Equal(t, bp.AutomountServiceAccountToken, cp.AutomountServiceAccountToken)
		require.Equal(t, bp.EnableServiceLinks, cp.EnableServiceLinks)
		require.Equal(t, bp.TerminationGracePeriodSeconds, cp.TerminationGracePeriodSeconds)
		require.Len(t, cp.Containers, 1)
		bc, cc := bp.Containers[0], cp.Containers[0]
		require.Equal(t, "ghcr.io/tokenbroker/tokenbroker:v0.1.0", cc.Image, "the default tag is the chart's appVersion")
		require.Equal(t, bc.SecurityContext, cc.SecurityContext)
		require.Equal(t, bc.Resources, cc.Resources)
		require.Equal(t, bc.Ports, cc.Ports)
		require.Equal(t, bc.LivenessProbe, cc.LivenessProbe)
		require.Equal(t, bc.ReadinessProbe, cc.ReadinessProbe)
		require.Equal(t, bc.Env, cc.Env)
		require.Equal(t, bc.VolumeMounts, cc.VolumeMounts)
		require.Equal(t, bc.Args, cc.Args, "the same args as deploy/base, which the container test runs (image_test.go)")
		require.Contains(t, cc.Args, "--audit-log=stdout")
		for _, v := range bp.Volumes {
			if v.Secret != nil {
				require.Contains(t, cp.Volumes, v, "the same Secret volume")
			}
		}

		// Spelled out as well, so that a change to both cannot go unnoticed.
		requireHardened(t, cp)
		require.Equal(t, ptrTo(int64(65532)), cp.SecurityContext.RunAsUser)

		anti := cp.Affinity.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution
		require.Len(t, anti, 1, "soft anti-affinity by default")
		require.Equal(t, "kubernetes.io/hostname", anti[0].PodAffinityTerm.TopologyKey)
		require.Equal(t, cd.Spec.Selector, anti[0].PodAffinityTerm.LabelSelector)
	})

	t.Run("every Deployment arg is a flag tokenbroker serve knows", func(t *testing.T) {
		for _, docs := range [][]manifest{defaults, everything} {
			d := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "tokenbroker"))
			requireKnownServeFlags(t, d.Spec.Template.Spec.Containers[0].Args, help)
		}
	})

	t.Run("with every option on, the Deployment enrolls, mounts its inputs read-only and keeps the hardening", func(t *testing.T) {
		d := decode[appsv1.Deployment](t, findManifest(t, everything, "Deployment", "tokenbroker"))
		pod := d.Spec.Template.Spec
		ctr := pod.Containers[0]
		require.Equal(t, ptrTo(int32(3)), d.Spec.Replicas)
		require.Equal(t, "ghcr.io/tokenbroker/tokenbroker:v0.2.0", ctr.Image)
		for _, a := range []string{
			"--enroll-address=:8444", "--ca-cert-file=/etc/tokenbroker/ca/ca.crt", "--ca-key-file=/etc/tokenbroker/ca/ca.key",
			"--client-ca-file=/etc/tokenbroker/client-ca/bundle.crt", "--audit-log=/var/log/tokenbroker/audit.log",
			"--log-level=debug", "--gc-interval=30s", "--kube-qps=500",
			"--max-conns=4096", "--max-handshakes=2048", "--max-handshakes-per-ip=256", "--max-conns-per-ip=1024",
			"--max-conns-per-identity=512", "--handshake-timeout=2s",
			"--gateway-address=:8445", "--gateway-url=https://tokenbroker.east.example.com:9445",
			"--gateway-max-conns-per-lease=32", "--gateway-max-conns-per-peer=512",
			"--gateway-max-requests-per-lease=128", "--gateway-max-requests-per-peer=768",
		} {
			require.Contains(t, ctr.Args, a)
		}
		ports := map[string]int32{}
		for _, p := range ctr.Ports {
			ports[p.Name] = p.ContainerPort
		}
		require.Equal(t, map[string]int32{"https": 8443, "enroll": 8444, "gateway": 8445, "ops": 9090}, ports)
		require.Equal(t, "1", ctr.Resources.Limits.Cpu().String())
		require.Equal(t, "512Mi", ctr.Resources.Limits.Memory().String())
		require.True(t, *ctr.SecurityContext.ReadOnlyRootFilesystem)

		mounts := map[string]corev1.VolumeMount{}
		for _, m := range ctr.VolumeMounts {
			mounts[m.Name] = m
		}
		for _, name := range []string{"tls", "client-ca", "policy", "signing-ca"} {
			require.True(t, mounts[name].ReadOnly, "volume %s must be mounted read-only", name)
		}
		require.False(t, mounts["audit"].ReadOnly, "the audit log's volume is the writable one")
		volumes := map[string]corev1.Volume{}
		for _, v := range pod.Volumes {
			volumes[v.Name] = v
		}
		require.Equal(t, "east-broker-tls", volumes["tls"].Secret.SecretName)
		require.Equal(t, "tokenbroker-client-ca", volumes["client-ca"].ConfigMap.Name)
		require.Equal(t, "tokenbroker-ca", volumes["signing-ca"].Secret.SecretName)
		require.Equal(t, []corev1.KeyToPath{{Key: "tls.crt", Path: "ca.crt"}, {Key: "tls.key", Path: "ca.key"}}, volumes["signing-ca"].Secret.Items)

		require.Len(t, pod.Affinity.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution, 1, "podAntiAffinity: hard")
		require.Len(t, pod.TopologySpreadConstraints, 1)
		require.Equal(t, d.Spec.Selector, pod.TopologySpreadConstraints[0].LabelSelector, "a constraint without labelSelector gets the pods' labels")
		require.Equal(t, "system-cluster-critical", pod.PriorityClassName)
		require.Equal(t, "false", d.Spec.Template.Annotations["example.com/scrape"])
		require.Equal(t, "platform", d.Spec.Template.Labels["example.com/team"])

		svc := decode[corev1.Service](t, findManifest(t, everything, "Service", "tokenbroker"))
		require.Equal(t, corev1.ServiceTypeLoadBalancer, svc.Spec.Type)
		require.Equal(t, []corev1.ServicePort{
			{Name: "https", Port: 8443, TargetPort: intstr.FromString("https"), Protocol: corev1.ProtocolTCP},
			{Name: "enroll", Port: 9444, TargetPort: intstr.FromString("enroll"), Protocol: corev1.ProtocolTCP},
			{Name: "gateway", Port: 9445, TargetPort: intstr.FromString("gateway"), Protocol: corev1.ProtocolTCP},
		}, svc.Spec.Ports, "the API Service never exposes the ops port")
		require.Equal(t, []string{"203.0.113.0/24"}, svc.Spec.LoadBalancerSourceRanges)
	})

	t.Run("a PodDisruptionBudget exists only when enabled and there is more than one replica", func(t *testing.T) {
		pdb := decode[policyv1.PodDisruptionBudget](t, findManifest(t, defaults, "PodDisruptionBudget", "tokenbroker"))
		require.Equal(t, intstr.FromInt32(1), *pdb.Spec.MinAvailable)
		d := decode[appsv1.Deployment](t, findManifest(t, defaults, "Deployment", "tokenbroker"))
		require.Equal(t, d.Spec.Selector, pdb.Spec.Selector)
		pdb = decode[policyv1.PodDisruptionBudget](t, findManifest(t, everything, "PodDisruptionBudget", "tokenbroker"))
		require.Equal(t, intstr.FromInt32(2), *pdb.Spec.MinAvailable)

		require.Empty(t, manifestsOf(h.render(t, "-f", h.values("default"), "--set", "replicaCount=1"), "PodDisruptionBudget"))
		require.Empty(t, manifestsOf(h.render(t, "-f", h.values("default"), "--set", "podDisruptionBudget.enabled=false"), "PodDisruptionBudget"))
	})

	t.Run("the NetworkPolicy admits the API ports from the configured peers, the ops port from monitoring, and egress to the API server and DNS", func(t *testing.T) {
		require.Empty(t, manifestsOf(defaults, "NetworkPolicy"), "off by default")
		tcp, udp := ptrTo(corev1.ProtocolTCP), ptrTo(corev1.ProtocolUDP)
		port := func(p int32, proto *corev1.Protocol) networkingv1.NetworkPolicyPort {
			return networkingv1.NetworkPolicyPort{Port: ptrTo(intstr.FromInt32(p)), Protocol: proto}
		}
		np := decode[networkingv1.NetworkPolicy](t, findManifest(t, everything, "NetworkPolicy", "tokenbroker"))
		d := decode[appsv1.Deployment](t, findManifest(t, everything, "Deployment", "tokenbroker"))
		require.Equal(t, *d.Spec.Selector, np.Spec.PodSelector)
		require.ElementsMatch(t, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}, np.Spec.PolicyTypes)
		require.Equal(t, []networkingv1.NetworkPolicyIngressRule{
			{
				Ports: []networkingv1.NetworkPolicyPort{port(8443, tcp), port(8444, tcp), port(8445, tcp)},
				From:  []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "203.0.113.0/24"}}},
			},
			{
				Ports: []networkingv1.NetworkPolicyPort{port(9090, tcp)},
				From: []networkingv1.NetworkPolicyPeer{{
					NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": "monitoring"}},
					PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"app.kubernetes.io/name": "prometheus"}},
				}},
			},
		}, np.Spec.Ingress)
		require.Equal(t, []networkingv1.NetworkPolicyEgressRule{
			{
				Ports: []networkingv1.NetworkPolicyPort{port(443, tcp), port(6443, tcp)},
				To:    []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: "10.0.0.1/32"}}, {IPBlock: &networkingv1.IPBlock{CIDR: "192.0.2.10/32"}}},
			},
			{
				Ports: []networkingv1.NetworkPolicyPort{port(53, udp), port(53, tcp)},
				To:    []networkingv1.NetworkPolicyPeer{{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": "kube-system"}}}},
			},
		}, np.Spec.Egress)

		np = decode[networkingv1.NetworkPolicy](t, findManifest(t, h.render(t, "-f", h.values("default"), "--set", "networkPolicy.enabled=true"), "NetworkPolicy", "tokenbroker"))
		require.Equal(t, []networkingv1.NetworkPolicyIngressRule{
			{Ports: []networkingv1.NetworkPolicyPort{port(8443, tcp)}},
			{
				Ports: []networkingv1.NetworkPolicyPort{port(9090, tcp)},
				From:  []networkingv1.NetworkPolicyPeer{{NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": "monitoring"}}}},
			},
		}, np.Spec.Ingress, "defaults: the API from anywhere, the ops port from the namespace monitoring only")
		require.Equal(t, []networkingv1.NetworkPolicyEgressRule{
			{Ports: []networkingv1.NetworkPolicyPort{port(443, tcp), port(6443, tcp)}},
			{Ports: []networkingv1.NetworkPolicyPort{port(53, udp), port(53, tcp)}},
		}, np.Spec.Egress)
	})

	t.Run("the ServiceMonitor scrapes the ops port through a metrics Service of its own", func(t *testing.T) {
		require.Empty(t, manifestsOf(defaults, "ServiceMonitor"), "off by default")
		sm := decode[serviceMonitor](t, findManifest(t, everything, "ServiceMonitor", "tokenbroker"))
		require.Equal(t, "monitoring.coreos.com/v1", sm.APIVersion)
		require.Equal(t, "prometheus", sm.Metadata.Labels["release"])
		require.Equal(t, []string{"tokenbroker"}, sm.Spec.NamespaceSelector.MatchNames)
		require.Len(t, sm.Spec.Endpoints, 1)
		ep := sm.Spec.Endpoints[0]
		require.Equal(t, "ops", ep.Port)
		require.Equal(t, "/metrics", ep.Path)
		require.Equal(t, "15s", ep.Interval)
		require.Equal(t, "10s", ep.ScrapeTimeout)

		selector, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		require.NoError(t, err)
		metrics := decode[corev1.Service](t, findManifest(t, everything, "Service", "tokenbroker-metrics"))
		api := decode[corev1.Service](t, findManifest(t, everything, "Service", "tokenbroker"))
		require.True(t, selector.Matches(labels.Set(metrics.Labels)))
		require.False(t, selector.Matches(labels.Set(api.Labels)), "the API Service is not scraped")
		require.Equal(t, []corev1.ServicePort{{Name: "ops", Port: 9090, TargetPort: intstr.FromString("ops"), Protocol: corev1.ProtocolTCP}}, metrics.Spec.Ports)
		d := decode[appsv1.Deployment](t, findManifest(t, everything, "Deployment", "tokenbroker"))
		require.True(t, labels.SelectorFromSet(metrics.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)))
		require.Contains(t, d.Spec.Template.Spec.Containers[0].Ports, corev1.ContainerPort{Name: "ops", ContainerPort: 9090, Protocol: corev1.ProtocolTCP})
	})

	t.Run("the default policy is deploy/base's: valid, and it denies everything", func(t *testing.T) {
		cm := decode[corev1.ConfigMap](t, findManifest(t, defaults, "ConfigMap", "tokenbroker-policy"))
		chartPolicy, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
		require.NoError(t, err)
		require.Empty(t, chartPolicy.Peers)
		basePolicy, err := policy.Parse([]byte(decode[corev1.ConfigMap](t, findManifest(t, base, "ConfigMap", "")).Data["policy.yaml"]))
		require.NoError(t, err)
		require.Equal(t, basePolicy, chartPolicy)
		requireValidPolicyFile(t, writeFile(t, filepath.Join(t.TempDir(), "policy.yaml"), cm.Data["policy.yaml"]))
	})

	t.Run("the policy value round-trips into a policy file the broker accepts", func(t *testing.T) {
		cm := decode[corev1.ConfigMap](t, findManifest(t, everything, "ConfigMap", "tokenbroker-policy"))
		data := cm.Data["policy.yaml"]
		p, err := policy.Parse([]byte(data))
		require.NoError(t, err)
		require.Equal(t, "east", p.Cluster.Name)
		require.Empty(t, p.Cluster.CAFile, "caFile: null removes the default")
		require.Contains(t, p.Cluster.CAData, "BEGIN CERTIFICATE")
		require.Len(t, p.Peers, 2)
		require.Equal(t, []string{"reconciler", "reader"}, p.Peers[1].Grants[0].ServiceAccounts)

		// The file as the broker loads it, caData's certificates included.
		file := writeFile(t, filepath.Join(t.TempDir(), "policy.yaml"), data)
		_, err = policy.LoadFile(file)
		require.NoError(t, err)
		requireValidPolicyFile(t, file)
	})

	t.Run("the values in docs/operations.md render with only the granted namespace bound and a valid policy", func(t *testing.T) {
		doc := readDoc(t, "docs/operations.md")
		require.Contains(t, doc, "helm install tokenbroker deploy/helm/tokenbroker -n tokenbroker --create-namespace -f east.yaml")
		block := fencedBlock(t, doc, "yaml", "   # east.yaml")
		lines := strings.Split(block, "\n")
		for i, l := range lines {
			lines[i] = strings.TrimPrefix(l, "   ")
		}
		values := writeFile(t, filepath.Join(t.TempDir(), "east.yaml"), strings.Join(lines, "\n"))
		docs := h.render(t, "-f", values)
		// The only cluster-wide binding is the namespace cache's list and watch.
		require.Equal(t, []string{"ClusterRoleBinding/tokenbroker-namespaces"}, kindNames(manifestsOf(docs, "ClusterRoleBinding")))
		rb := decode[rbacv1.RoleBinding](t, findManifest(t, docs, "RoleBinding", "tokenbroker-issue"))
		require.Equal(t, "argo", rb.Namespace)
		svc := decode[corev1.Service](t, findManifest(t, docs, "Service", "tokenbroker"))
		require.Equal(t, corev1.ServiceTypeLoadBalancer, svc.Spec.Type)
		cm := decode[corev1.ConfigMap](t, findManifest(t, docs, "ConfigMap", "tokenbroker-policy"))
		p, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
		require.NoError(t, err)
		require.Equal(t, "west", p.Peers[0].Name)
		requireValidPolicyFile(t, writeFile(t, filepath.Join(t.TempDir(), "policy.yaml"), cm.Data["policy.yaml"]))
	})

	t.Run("existingPolicyConfigMap replaces the chart's ConfigMap", func(t *testing.T) {
		docs := h.render(t, "-f", h.values("default"), "--set", "existingPolicyConfigMap=my-policy")
		require.Empty(t, manifestsOf(docs, "ConfigMap"))
		d := decode[appsv1.Deployment](t, findManifest(t, docs, "Deployment", "tokenbroker"))
		require.Contains(t, d.Spec.Template.Spec.Volumes, corev1.Volume{Name: "policy", VolumeSource: corev1.VolumeSource{
			ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "my-policy"}, DefaultMode: ptrTo(int32(0o444))},
		}})
	})

	t.Run("a policy change leaves the Deployment as it is: the broker reloads the policy, no rollout", func(t *testing.T) {
		changed := h.render(t, "-f", h.values("default"), "--set", "policy.ttl.max=12h")
		require.NotEqual(t, string(findManifest(t, defaults, "ConfigMap", "tokenbroker-policy").raw), string(findManifest(t, changed, "ConfigMap", "tokenbroker-policy").raw))
		require.Equal(t, string(findManifest(t, defaults, "Deployment", "tokenbroker").raw), string(findManifest(t, changed, "Deployment", "tokenbroker").raw))
	})
}

// requireValidPolicyFile checks a policy file with `tokenbroker config
// validate`, as an operator would before installing it.
func requireValidPolicyFile(t *testing.T, file string) {
	t.Helper()
	out, errOut, err := runErr(tokenbrokerBinary(t), "config", "validate", "--kind", "policy", file)
	require.NoError(t, err, "%s%s", out, errOut)
	require.Equal(t, file+": valid policy config\n", out)
}

// serviceMonitorCRD stands in for the Prometheus Operator's CRD: the fields
// the chart writes, typed as upstream, so that the API server's strict field
// validation catches a misspelt one.
const serviceMonitorCRD = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: servicemonitors.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  names: {kind: ServiceMonitor, listKind: ServiceMonitorList, plural: servicemonitors, singular: servicemonitor}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [selector]
              properties:
                namespaceSelector:
                  type: object
                  properties:
                    any: {type: boolean}
                    matchNames: {type: array, items: {type: string}}
                selector:
                  type: object
                  x-kubernetes-preserve-unknown-fields: true
                endpoints:
                  type: array
                  items:
                    type: object
                    properties:
                      port: {type: string}
                      path: {type: string}
                      scheme: {type: string, enum: [http, https]}
                      interval: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
                      scrapeTimeout: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
`

// prometheusRuleCRD stands in for the Prometheus Operator's PrometheusRule
// CRD the same way: groups and rules with upstream's types and required
// fields, durations with its pattern.
const prometheusRuleCRD = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: prometheusrules.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  names: {kind: PrometheusRule, listKind: PrometheusRuleList, plural: prometheusrules, singular: prometheusrule}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            spec:
              type: object
              properties:
                groups:
                  type: array
                  items:
                    type: object
                    required: [name]
                    properties:
                      name: {type: string, minLength: 1}
                      interval: {type: string}
                      rules:
                        type: array
                        items:
                          type: object
                          required: [expr]
                          properties:
                            alert: {type: string}
                            record: {type: string}
                            expr: {x-kubernetes-int-or-string: true}
                            for: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
                            labels: {type: object, additionalProperties: {type: string}}
                            annotations: {type: object, additionalProperties: {type: string}}
`

// applyChartPrerequisites creates for real what a server-side dry run of a
// chart needs, since a dry run persists nothing: the release namespace with
// the "restricted" Pod Security level enforced (and warned of), the other
// namespaces its objects live in, and the monitoring CRDs.
func applyChartPrerequisites(t *testing.T, kubectl string, c *testcluster.Cluster, release string, namespaces ...string) {
	t.Helper()
	doc := fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: %s
  labels:
    pod-security.kubernetes.io/enforce: restricted
    pod-security.kubernetes.io/warn: restricted
`, release)
	for _, ns := range namespaces {
		doc += "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: " + ns + "}\n"
	}
	applyYAML(t, kubectl, c, doc+"---\n"+serviceMonitorCRD+"---\n"+prometheusRuleCRD)
	waitEstablished(t, kubectl, c.KubeconfigPath, "crd/servicemonitors.monitoring.coreos.com", "crd/prometheusrules.monitoring.coreos.com")
}

// waitEstablished waits until the CRDs are Established. kubectl wait
// fails at once, instead of waiting, on a CRD whose status has no
// conditions yet (".status.conditions accessor error"), which a CRD just
// created can have: it is asked again until it succeeds.
func waitEstablished(t *testing.T, kubectl, kubeconfig string, crds ...string) {
	t.Helper()
	require.Eventually(t, func() bool {
		_, _, err := runErr(kubectl, append([]string{"--kubeconfig", kubeconfig, "wait", "--for=condition=Established", "--timeout=5s"}, crds...)...)
		return err == nil
	}, 30*time.Second, 200*time.Millisecond, "the CRDs %v are established", crds)
}

// TestHelmChartAgainstAPIServer checks the chart against a real API server:
// every object it renders, with the defaults and with every option on, is
// accepted in a server-side dry run with the namespace's "restricted" Pod
// Security level in force (a pod of the Deployment's template is admitted
// under enforce); `helm install`, `helm upgrade` and `helm uninstall` work
// as docs/operations.md describes, a policy-only upgrade does not roll the
// Deployment, and uninstalling leaves lease Secrets, which the documented
// command removes.
func TestHelmChartAgainstAPIServer(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	h := newHelm(t)
	kubectl := kubectlBinary(t)
	admin := []string{"--kubeconfig", c.KubeconfigPath}
	ctx := context.Background()

	applyChartPrerequisites(t, kubectl, c, "tokenbroker", "argo", "flux", "monitoring")

	t.Run("a server-side dry run accepts every object, without Pod Security warnings", func(t *testing.T) {
		for _, tc := range []struct {
			values string
			want   []string
		}{
			{"default", []string{
				"serviceaccount/tokenbroker",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-issue",
				"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-issue",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-namespaces",
				"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-namespaces",
				"role.rbac.authorization.k8s.io/tokenbroker-self",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-self",
				"configmap/tokenbroker-policy",
				"service/tokenbroker",
				"deployment.apps/tokenbroker",
				"poddisruptionbudget.policy/tokenbroker",
			}},
			{"everything", []string{
				"serviceaccount/tokenbroker",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-issue",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-issue",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-issue",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-namespaces",
				"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-namespaces",
				"role.rbac.authorization.k8s.io/tokenbroker-self",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-self",
				"configmap/tokenbroker-policy",
				"service/tokenbroker",
				"service/tokenbroker-metrics",
				"deployment.apps/tokenbroker",
				"poddisruptionbudget.policy/tokenbroker",
				"networkpolicy.networking.k8s.io/tokenbroker",
				"servicemonitor.monitoring.coreos.com/tokenbroker",
				"prometheusrule.monitoring.coreos.com/tokenbroker",
				"configmap/tokenbroker-dashboard",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-trust-bundle",
				"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-trust-bundle",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-csr",
				"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-csr",
				"clusterrole.rbac.authorization.k8s.io/tokenbroker-bind",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-bind",
				"rolebinding.rbac.authorization.k8s.io/tokenbroker-bind",
				"validatingadmissionpolicy.admissionregistration.k8s.io/tokenbroker-approves-only-its-own-csrs",
				"validatingadmissionpolicybinding.admissionregistration.k8s.io/tokenbroker-approves-only-its-own-csrs",
			}},
		} {
			file := writeFile(t, filepath.Join(t.TempDir(), tc.values+".yaml"), h.template(t, "-f", h.values(tc.values)))
			stdout, stderr, err := runErr(kubectl, append(admin, "apply", "--dry-run=server", "-f", file, "-o", "name")...)
			require.NoError(t, err, "%s values\nstdout: %s\nstderr: %s", tc.values, stdout, stderr)
			require.NotContains(t, stderr, "Warning", "%s values: the Deployment must meet the restricted Pod Security Standard", tc.values)
			require.ElementsMatch(t, tc.want, strings.Fields(stdout), tc.values)
		}
		_, err := c.Client.AppsV1().Deployments("tokenbroker").Get(ctx, "tokenbroker", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "a dry run must not create the Deployment: %v", err)
	})

	t.Run("helm install with every option on creates the release: RoleBindings in just the granted namespaces", func(t *testing.T) {
		out := h.run(t, append(admin, "install", "tokenbroker", h.chart, "-n", "tokenbroker", "--create-namespace", "-f", h.values("everything"))...)
		require.Contains(t, out, "STATUS: deployed")
		require.Contains(t, out, "kubectl delete secrets -A -l tokenbroker.io/kind=lease", "NOTES.txt says how to remove the leases")
		for _, ns := range []string{"argo", "flux"} {
			_, err := c.Client.RbacV1().RoleBindings(ns).Get(ctx, "tokenbroker-issue", metav1.GetOptions{})
			require.NoError(t, err, ns)
		}
		_, err := c.Client.RbacV1().ClusterRoleBindings().Get(ctx, "tokenbroker-issue", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "rbac.namespaces: no ClusterRoleBinding: %v", err)
	})

	t.Run("a pod of the Deployment's template is admitted under enforce=restricted, and a weakened one is not", func(t *testing.T) {
		for _, values := range []string{"default", "everything"} {
			d := decode[appsv1.Deployment](t, findManifest(t, h.render(t, "-f", h.values(values)), "Deployment", "tokenbroker"))
			pod := corev1.Pod{
				TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
				ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-" + values, Namespace: "tokenbroker", Labels: d.Spec.Template.Labels},
				Spec:       d.Spec.Template.Spec,
			}
			stdout, stderr, err := runErr(kubectl, append(admin, "apply", "--dry-run=server", "-f", writeFile(t, filepath.Join(t.TempDir(), "pod.yaml"), string(must(yaml.Marshal(pod)))))...)
			require.NoError(t, err, "%s values\nstdout: %s\nstderr: %s", values, stdout, stderr)

			// The check is really in force: without the capability drop the
			// same pod is refused.
			pod.Spec.Containers[0].SecurityContext = pod.Spec.Containers[0].SecurityContext.DeepCopy()
			pod.Spec.Containers[0].SecurityContext.Capabilities = nil
			_, stderr, err = runErr(kubectl, append(admin, "apply", "--dry-run=server", "-f", writeFile(t, filepath.Join(t.TempDir(), "pod.yaml"), string(must(yaml.Marshal(pod)))))...)
			require.Error(t, err)
			require.Contains(t, stderr, `violates PodSecurity "restricted:latest"`)
		}
	})

	t.Run("helm upgrade with a new policy changes the ConfigMap and does not roll the Deployment", func(t *testing.T) {
		before, err := c.Client.AppsV1().Deployments("tokenbroker").Get(ctx, "tokenbroker", metav1.GetOptions{})
		require.NoError(t, err)
		h.run(t, append(admin, "upgrade", "tokenbroker", h.chart, "-n", "tokenbroker", "-f", h.values("everything"), "--set", "policy.ttl.max=6h")...)
		cm, err := c.Client.CoreV1().ConfigMaps("tokenbroker").Get(ctx, "tokenbroker-policy", metav1.GetOptions{})
		require.NoError(t, err)
		p, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
		require.NoError(t, err)
		require.Equal(t, 6*time.Hour, time.Duration(p.TTL.Max))
		after, err := c.Client.AppsV1().Deployments("tokenbroker").Get(ctx, "tokenbroker", metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, before.Generation, after.Generation, "the pod template did not change")

		// A change to the pods does roll it: the check above can fail.
		h.run(t, append(admin, "upgrade", "tokenbroker", h.chart, "-n", "tokenbroker", "-f", h.values("everything"), "--set", "policy.ttl.max=6h", "--set", "logLevel=info")...)
		after, err = c.Client.AppsV1().Deployments("tokenbroker").Get(ctx, "tokenbroker", metav1.GetOptions{})
		require.NoError(t, err)
		require.Greater(t, after.Generation, before.Generation)
	})

	t.Run("helm uninstall removes the chart's objects and leaves lease Secrets, which the documented command deletes", func(t *testing.T) {
		lease := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-lease-test", Namespace: "argo", Labels: map[string]string{objects.LabelKind: objects.LeaseKind}}}
		_, err := c.Client.CoreV1().Secrets("argo").Create(ctx, lease, metav1.CreateOptions{})
		require.NoError(t, err)

		h.run(t, append(admin, "uninstall", "tokenbroker", "-n", "tokenbroker")...)
		_, err = c.Client.RbacV1().ClusterRoles().Get(ctx, "tokenbroker-issue", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "%v", err)
		_, err = c.Client.RbacV1().RoleBindings("argo").Get(ctx, "tokenbroker-issue", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "%v", err)
		_, err = c.Client.CoreV1().Secrets("argo").Get(ctx, lease.Name, metav1.GetOptions{})
		require.NoError(t, err, "helm does not know the broker's lease Secrets")

		run(t, kubectl, append(admin, "delete", "secrets", "-A", "-l", "tokenbroker.io/kind=lease")...)
		_, err = c.Client.CoreV1().Secrets("argo").Get(ctx, lease.Name, metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "%v", err)
	})
}
