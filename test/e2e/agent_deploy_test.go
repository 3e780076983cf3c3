package e2e

import (
	"context"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestDeployAgent checks deploy/agent against a real API server: it
// renders, the API server accepts every object in a server-side dry run
// with the "restricted" Pod Security level in force, the Deployment is
// hardened and runs `tokenbroker agent` with the generated ConfigMap, the
// example agent.yaml is accepted by the agent's own loader and names
// exactly the Secrets the RBAC covers, and the agent's ServiceAccount can
// write those Secrets and nothing else.
func TestDeployAgent(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	kubectl := kubectlBinary(t)
	base := filepath.Join(repoRoot(t), "deploy", "agent")
	admin := []string{"--kubeconfig", c.KubeconfigPath}

	docs := splitManifests(t, run(t, kubectl, "kustomize", base))
	configCM := findManifest(t, docs, "ConfigMap", "")
	require.Regexp(t, `^tokenbroker-agent-config-[a-z0-9]+$`, configCM.Metadata.Name, "the config ConfigMap is generated with a hash suffix")
	var deployment appsv1.Deployment
	require.NoError(t, yaml.UnmarshalStrict(findManifest(t, docs, "Deployment", "tokenbroker-agent").raw, &deployment))
	var cm corev1.ConfigMap
	require.NoError(t, yaml.Unmarshal(configCM.raw, &cm))
	require.Contains(t, cm.Data, "agent.yaml")
	roles := map[string]rbacv1.Role{} // by namespace
	for _, d := range docs {
		if d.Kind == "Role" {
			var r rbacv1.Role
			require.NoError(t, yaml.UnmarshalStrict(d.raw, &r))
			roles[r.Namespace] = r
		}
	}

	// A server-side dry run persists nothing, so the namespaces the objects
	// live in must exist for real: the agent's own (with its Pod Security
	// labels, which the dry run of the Deployment is then checked against)
	// and every output namespace, which the agent does not create.
	nsFile := writeFile(t, filepath.Join(t.TempDir(), "namespace.yaml"), string(findManifest(t, docs, "Namespace", "tokenbroker-agent").raw))
	run(t, kubectl, append(admin, "apply", "-f", nsFile)...)
	for ns := range roles {
		if ns == "tokenbroker-agent" {
			continue
		}
		_, err := c.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}

	t.Run("a server-side dry run accepts every object, without Pod Security warnings", func(t *testing.T) {
		stdout, stderr, err := runErr(kubectl, append(admin, "apply", "-k", base, "--dry-run=server", "-o", "name")...)
		require.NoError(t, err, "stdout: %s\nstderr: %s", stdout, stderr)
		require.NotContains(t, stderr, "Warning", "the Deployment must meet the restricted Pod Security Standard")
		require.ElementsMatch(t, []string{
			"namespace/tokenbroker-agent",
			"serviceaccount/tokenbroker-agent",
			"role.rbac.authorization.k8s.io/tokenbroker-agent-identity",
			"rolebinding.rbac.authorization.k8s.io/tokenbroker-agent-identity",
			"role.rbac.authorization.k8s.io/tokenbroker-agent-output",
			"rolebinding.rbac.authorization.k8s.io/tokenbroker-agent-output",
			"configmap/" + configCM.Metadata.Name,
			"deployment.apps/tokenbroker-agent",
		}, strings.Fields(stdout))
		for _, d := range docs {
			require.NotEqual(t, "ClusterRole", d.Kind, "the agent needs nothing cluster-wide")
			require.NotEqual(t, "ClusterRoleBinding", d.Kind, "the agent needs nothing cluster-wide")
		}
		_, err = c.Client.AppsV1().Deployments("tokenbroker-agent").Get(context.Background(), "tokenbroker-agent", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "a dry run must not create the Deployment: %v", err)
	})

	t.Run("the Deployment is hardened, probed on the ops port and mounts its inputs read-only", func(t *testing.T) {
		pod := deployment.Spec.Template.Spec
		require.Equal(t, ptrTo(int32(1)), deployment.Spec.Replicas, "one agent per source cluster")
		require.Equal(t, appsv1.RecreateDeploymentStrategyType, deployment.Spec.Strategy.Type, "never two agents at once, not even during a rollout")
		require.Equal(t, "tokenbroker-agent", pod.ServiceAccountName)
		require.Len(t, pod.Containers, 1)
		ctr := pod.Containers[0]
		require.Equal(t, imageRef(t), ctr.Image, "the image make image tags")

		requireHardened(t, pod)

		require.Len(t, ctr.Ports, 1, "only the operations port")
		require.Equal(t, "ops", ctr.Ports[0].Name)
		require.Equal(t, int32(9091), ctr.Ports[0].ContainerPort)
		require.Equal(t, "/healthz", ctr.LivenessProbe.HTTPGet.Path)
		require.Equal(t, "ops", ctr.LivenessProbe.HTTPGet.Port.String())
		require.Equal(t, "/readyz", ctr.ReadinessProbe.HTTPGet.Path)
		require.Equal(t, "ops", ctr.ReadinessProbe.HTTPGet.Port.String())
		require.False(t, ctr.Resources.Requests.Cpu().IsZero())
		require.False(t, ctr.Resources.Requests.Memory().IsZero())
		require.False(t, ctr.Resources.Limits.Memory().IsZero())

		mounts := map[string]string{}
		for _, m := range ctr.VolumeMounts {
			require.True(t, m.ReadOnly, "volume %s must be mounted read-only", m.Name)
			mounts[m.Name] = m.MountPath
		}
		require.Equal(t, map[string]string{"config": "/etc/tokenbroker-agent", "join": "/var/run/tokenbroker/join"}, mounts)
		for _, v := range pod.Volumes {
			switch v.Name {
			case "config":
				require.NotNil(t, v.ConfigMap)
				require.Equal(t, configCM.Metadata.Name, v.ConfigMap.Name, "the Deployment refers to the generated ConfigMap")
			case "join":
				require.NotNil(t, v.Secret)
				require.Equal(t, "tokenbroker-agent-join", v.Secret.SecretName)
				require.Equal(t, ptrTo(true), v.Secret.Optional, "the pod must start once the used join token is gone")
			default:
				t.Fatalf("unexpected volume %s", v.Name)
			}
		}
	})

	t.Run("the Deployment runs tokenbroker agent with the configuration file from the ConfigMap", func(t *testing.T) {
		args := deployment.Spec.Template.Spec.Containers[0].Args
		require.Equal(t, []string{"agent", "--config=/etc/tokenbroker-agent/agent.yaml", "--log-format=json", "--log-level=info"}, args)
		help := run(t, tokenbrokerBinary(t), "agent", "--help")
		for _, flag := range []string{"--config", "--log-format", "--log-level"} {
			require.Regexp(t, `(?m)^\s+`+flag+`\s`, help, "tokenbroker agent has a %s flag", flag)
		}
	})

	// The example as the agent reads it, with its own loader: strict, so an
	// unknown or misspelt key fails here rather than in a user's cluster.
	cfgFile := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), cm.Data["agent.yaml"])
	cfg, err := config.Load(cfgFile)
	require.NoError(t, err, "deploy/agent/agent.yaml must be accepted by the agent's loader")

	t.Run("the example agent.yaml in the ConfigMap is accepted by the agent's loader and fits the Deployment", func(t *testing.T) {
		require.NotNil(t, cfg.Identity.Secret, "in a Deployment the identity lives in a Secret, so it survives restarts")
		require.Empty(t, cfg.Identity.Dir)
		require.Empty(t, cfg.Kubeconfig, "in-cluster: the ServiceAccount's own credentials")
		require.NotNil(t, cfg.Identity.Enroll)
		require.Equal(t, "/var/run/tokenbroker/join", path.Dir(cfg.Identity.Enroll.TokenFile), "the join token is read from the mounted Secret")
		require.Regexp(t, `:9091$`, cfg.OpsAddress, "the probes' port")
		require.NotEmpty(t, cfg.Targets)
		for _, tg := range cfg.Targets {
			for _, o := range tg.Outputs {
				require.Nil(t, o.File, "the root file system is read-only and there is no writable volume")
			}
		}
	})

	t.Run("the example's identity and output Secrets are exactly the ones the Roles name", func(t *testing.T) {
		want := map[string][]string{cfg.Identity.Secret.Namespace: {cfg.Identity.Secret.Name}}
		for _, tg := range cfg.Targets {
			for _, o := range tg.Outputs {
				want[o.Secret.Namespace] = append(want[o.Secret.Namespace], o.Secret.Name)
			}
		}
		got := map[string][]string{}
		for ns, r := range roles {
			for _, rule := range r.Rules {
				if slices.Contains(rule.Verbs, "update") {
					got[ns] = append(got[ns], rule.ResourceNames...)
				}
			}
		}
		require.Len(t, got, len(want))
		for ns := range want {
			require.ElementsMatch(t, want[ns], got[ns], "namespace %s", ns)
		}
	})

	// From here on the ServiceAccount and its RBAC exist for real.
	var rbacYAML strings.Builder
	for _, d := range docs {
		if d.Kind == "ServiceAccount" || d.Kind == "Role" || d.Kind == "RoleBinding" {
			rbacYAML.WriteString("---\n")
			rbacYAML.Write(d.raw)
		}
	}
	run(t, kubectl, append(admin, "apply", "-f", writeFile(t, filepath.Join(t.TempDir(), "rbac.yaml"), rbacYAML.String()))...)

	sa, groups := testcluster.ServiceAccountUser("tokenbroker-agent", "tokenbroker-agent")
	out := cfg.Targets[0].Outputs[0].Secret
	id := cfg.Identity.Secret
	// The authorizer sees the applied binding a moment after it is written.
	require.NoError(t, testcluster.WaitAllowed(context.Background(), c.Client, sa, groups,
		authzv1.ResourceAttributes{Namespace: out.Namespace, Verb: "get", Resource: "secrets", Name: out.Name}))
	can := func(t *testing.T, attr authzv1.ResourceAttributes) bool {
		t.Helper()
		r, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authzv1.SubjectAccessReview{
			Spec: authzv1.SubjectAccessReviewSpec{User: sa, Groups: groups, ResourceAttributes: &attr},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		return r.Status.Allowed
	}

	t.Run("the agent's ServiceAccount can read, create and update the Secrets it writes", func(t *testing.T) {
		t.Parallel()
		for _, attr := range []authzv1.ResourceAttributes{
			{Namespace: out.Namespace, Verb: "get", Resource: "secrets", Name: out.Name},
			{Namespace: out.Namespace, Verb: "update", Resource: "secrets", Name: out.Name},
			{Namespace: out.Namespace, Verb: "create", Resource: "secrets"},
			{Namespace: id.Namespace, Verb: "get", Resource: "secrets", Name: id.Name},
			{Namespace: id.Namespace, Verb: "update", Resource: "secrets", Name: id.Name},
			{Namespace: id.Namespace, Verb: "create", Resource: "secrets"},
		} {
			require.True(t, can(t, attr), "%+v", attr)
		}
	})

	t.Run("the agent's ServiceAccount can touch no other Secret and nothing else", func(t *testing.T) {
		t.Parallel()
		for _, attr := range []authzv1.ResourceAttributes{
			// Other Secrets in the output namespace.
			{Namespace: out.Namespace, Verb: "get", Resource: "secrets", Name: "argo-server-sso"},
			{Namespace: out.Namespace, Verb: "update", Resource: "secrets", Name: "argo-server-sso"},
			{Namespace: out.Namespace, Verb: "list", Resource: "secrets"},
			{Namespace: out.Namespace, Verb: "watch", Resource: "secrets"},
			{Namespace: out.Namespace, Verb: "delete", Resource: "secrets", Name: out.Name},
			{Namespace: out.Namespace, Verb: "patch", Resource: "secrets", Name: out.Name},
			{Namespace: out.Namespace, Verb: "deletecollection", Resource: "secrets"},
			// Its own namespace: only its identity, and not even delete.
			{Namespace: id.Namespace, Verb: "get", Resource: "secrets", Name: "tokenbroker-agent-join"},
			{Namespace: id.Namespace, Verb: "list", Resource: "secrets"},
			{Namespace: id.Namespace, Verb: "delete", Resource: "secrets", Name: id.Name},
			// The output name in another namespace, and cluster-wide.
			{Namespace: "default", Verb: "get", Resource: "secrets", Name: out.Name},
			{Namespace: "default", Verb: "create", Resource: "secrets"},
			{Namespace: "kube-system", Verb: "create", Resource: "secrets"},
			{Verb: "list", Resource: "secrets"},
			// Anything but Secrets.
			{Namespace: out.Namespace, Verb: "get", Resource: "configmaps", Name: out.Name},
			{Namespace: out.Namespace, Verb: "create", Resource: "pods"},
			{Namespace: id.Namespace, Verb: "create", Resource: "serviceaccounts", Subresource: "token", Name: "tokenbroker-agent"},
			{Namespace: out.Namespace, Verb: "create", Resource: "rolebindings", Group: "rbac.authorization.k8s.io"},
		} {
			require.False(t, can(t, attr), "%+v", attr)
		}
	})
}

// TestEveryAgentConfigInTheDocsIsAcceptedByTheLoader parses every agent.yaml
// that docs/agent.md and the guides show with the agent's own strict
// loader, so that a renamed or misspelt key in the documentation fails
// here rather than in a user's cluster.
func TestEveryAgentConfigInTheDocsIsAcceptedByTheLoader(t *testing.T) {
	t.Parallel()
	for _, doc := range []string{"docs/agent.md", admiraltyGuide, argoCDGuide, fluxGuide, kargoGuide, capsuleGuide, "docs/guides/argo-workflows.md"} {
		text := readDoc(t, doc)
		n := 0
		for _, block := range fencedBlocks(text, "yaml") {
			if !strings.HasPrefix(block, "identity:") {
				continue
			}
			n++
			_, err := config.Parse([]byte(block), "")
			require.NoError(t, err, "%s: the agent.yaml\n%s", doc, block)
		}
		require.NotZero(t, n, "%s shows an agent.yaml", doc)
	}
}
