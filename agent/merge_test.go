package agent

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/agent/config"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// nextCredential is c with another lease and token, as a refresh brings.
func nextCredential(c *Credential) *Credential {
	next := *c
	next.LeaseID, next.Token = "k7b3xq2mzw4rd5tn6vy2abcdeg", "new-token"
	next.Kubeconfig = []byte(testKubeconfig("https://east.example.com:6443", "new-token"))
	return &next
}

func getSecret(t *testing.T, cs *fake.Clientset, ns, name string) *corev1.Secret {
	t.Helper()
	s, err := cs.CoreV1().Secrets(ns).Get(context.Background(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return s
}

func TestEveryFormatKeepsForeignKeysLabelsAndAnnotationsAcrossARefresh(t *testing.T) {
	t.Parallel()
	for _, format := range []string{config.FormatAdmiralty, config.FormatArgoCD, config.FormatFlux, config.FormatKubeconfig} {
		t.Run(format, func(t *testing.T) {
			t.Parallel()
			cs := fake.NewClientset()
			o := &secretOutput{cfg: config.SecretOutput{Namespace: "ns", Name: "east", Format: format}, secrets: cs.CoreV1()}
			ctx := context.Background()
			c := goldenCredential(t)
			_, err := o.write(ctx, goldenMeta, c)
			require.NoError(t, err)

			// What `argocd cluster set`, an operator or another tool adds.
			s := getSecret(t, cs, "ns", "east")
			s.Data["project"] = []byte("team-a")
			s.Data["extra"] = []byte("kept")
			s.Labels["team"] = "a"
			s.Annotations["example.com/owner"] = "ops"
			_, err = cs.CoreV1().Secrets("ns").Update(ctx, s, metav1.UpdateOptions{})
			require.NoError(t, err)

			wrote, err := o.write(ctx, goldenMeta, c)
			require.NoError(t, err)
			require.False(t, wrote, "others' additions alone do not make the Secret stale")

			next := nextCredential(c)
			wrote, err = o.write(ctx, goldenMeta, next)
			require.NoError(t, err)
			require.True(t, wrote)
			s = getSecret(t, cs, "ns", "east")
			require.Equal(t, "team-a", string(s.Data["project"]))
			require.Equal(t, "kept", string(s.Data["extra"]))
			require.Equal(t, "a", s.Labels["team"])
			require.Equal(t, "ops", s.Annotations["example.com/owner"])
			require.Equal(t, next.LeaseID, s.Annotations[config.AnnotationLeaseID])
			var owned ownedKeys
			require.NoError(t, json.Unmarshal([]byte(s.Annotations[config.AnnotationOwned]), &owned))
			require.NotContains(t, owned.Data, "extra")
			require.NotContains(t, owned.Labels, "team")
			require.NotContains(t, owned.Annotations, "example.com/owner")
		})
	}
}

func TestAKeyRenamedInTheConfigMovesTheKubeconfigAndDropsOnlyTheOldKey(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	ctx := context.Background()
	c := goldenCredential(t)
	old := &secretOutput{cfg: config.SecretOutput{Namespace: "kargo", Name: "east", Format: config.FormatKubeconfig, Labels: map[string]string{"was": "mine"}}, secrets: cs.CoreV1()}
	_, err := old.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	s := getSecret(t, cs, "kargo", "east")
	s.Data["notes"] = []byte("someone else's")
	_, err = cs.CoreV1().Secrets("kargo").Update(ctx, s, metav1.UpdateOptions{})
	require.NoError(t, err)

	renamed := &secretOutput{cfg: config.SecretOutput{Namespace: "kargo", Name: "east", Format: config.FormatKubeconfig, Key: "kubeconfig.yaml"}, secrets: cs.CoreV1()}
	wrote, err := renamed.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.True(t, wrote)
	s = getSecret(t, cs, "kargo", "east")
	require.Equal(t, c.Kubeconfig, s.Data["kubeconfig.yaml"])
	require.NotContains(t, s.Data, "kubeconfig", "the key the agent wrote before is gone")
	require.NotContains(t, s.Labels, "was", "so is a label the config no longer sets")
	require.Equal(t, "someone else's", string(s.Data["notes"]))

	st, err := renamed.read(ctx)
	require.NoError(t, err)
	require.Equal(t, c.Kubeconfig, st.kubeconfig, "a restart finds the kubeconfig under the new key")
}

func TestAForeignSecretIsRefusedUnlessTheOutputSaysAdopt(t *testing.T) {
	t.Parallel()
	foreign := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "argocd", Name: "east", Labels: map[string]string{"argocd.argoproj.io/secret-type": "cluster"}},
		Type:       corev1.SecretTypeOpaque,
		Data:       map[string][]byte{"name": []byte("east"), "server": []byte("https://old"), "config": []byte(`{"bearerToken":"long-lived"}`), "shard": []byte("2")},
	}
	cs := fake.NewClientset(foreign)
	ctx := context.Background()
	refused := &secretOutput{cfg: config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD}, secrets: cs.CoreV1()}
	_, err := refused.write(ctx, goldenMeta, goldenCredential(t))
	require.ErrorIs(t, err, ErrForeignSecret)
	require.ErrorContains(t, err, "adopt: true", "the error names the way out")
	require.Empty(t, writeActions(cs))

	adopt := &secretOutput{cfg: config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD, Adopt: true}, secrets: cs.CoreV1()}
	st, err := adopt.read(ctx)
	require.NoError(t, err)
	require.Nil(t, st, "nothing the agent wrote is there yet")
	wrote, err := adopt.write(ctx, goldenMeta, goldenCredential(t))
	require.NoError(t, err)
	require.True(t, wrote)
	s := getSecret(t, cs, "argocd", "east")
	require.Equal(t, config.ManagedByAgent, s.Labels[config.LabelManagedBy])
	require.Equal(t, "2", string(s.Data["shard"]), "a key the agent does not own is kept")
	require.Equal(t, "https://east.example.com:6443", string(s.Data["server"]))
	require.NotContains(t, string(s.Data["config"]), "long-lived")
}

func TestArgoCDOptionsAreWrittenAndOwnedOnlyWhenSet(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	c.TLSServerName, c.ProxyURL = "east.internal", "http://proxy.example.com:3128"
	yes := true
	shard := int64(3)
	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD, ArgoCD: &config.ArgoCDOptions{
		Name: "east-prod", Project: "team-a", Namespaces: []string{"apps", "jobs"}, ClusterResources: &yes, Shard: &shard,
	}}, goldenMeta, c)
	require.NoError(t, err)
	require.Equal(t, map[string]string{
		"name": "east-prod", "server": "https://east.example.com:6443", "project": "team-a",
		"namespaces": "apps,jobs", "clusterResources": "true", "shard": "3",
	}, stringDataExcept(s, "config"))
	var cfg argoClusterConfig
	require.NoError(t, json.Unmarshal(s.Data["config"], &cfg))
	require.Equal(t, "east.internal", cfg.TLSClientConfig.ServerName)
	require.Equal(t, "http://proxy.example.com:3128", cfg.ProxyURL)

	plain, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD}, goldenMeta, goldenCredential(t))
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"name", "server", "config"}, ownedFrom(plain).Data, "unset options are not the agent's")
	require.NotContains(t, string(plain.Data["config"]), "serverName")
	require.NotContains(t, string(plain.Data["config"]), "proxyUrl")
}

func stringDataExcept(s *corev1.Secret, skip string) map[string]string {
	out := map[string]string{}
	for k, v := range s.Data {
		if k != skip {
			out[k] = string(v)
		}
	}
	return out
}

func TestARestartAppliesChangedOutputSettingsAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cs := fake.NewClientset()
	out := func(cfg config.SecretOutput) *secretOutput { return &secretOutput{cfg: cfg, secrets: cs.CoreV1()} }
	base := config.SecretOutput{Namespace: "kargo", Name: "east", Format: config.FormatKubeconfig, Labels: map[string]string{"team": "a"}}
	first := newRefresherFixture(t, config.RefreshConfig{}, out(base))
	first.r.step(ctx)

	// A label changed: the credential the Secret holds is written again
	// under the new settings, without a fetch.
	relabelled := base
	relabelled.Labels = map[string]string{"team": "b"}
	f := newRefresherFixture(t, config.RefreshConfig{}, out(relabelled))
	f.clock.SetTime(t0.Add(5 * time.Minute))
	f.r.step(ctx)
	require.Zero(t, f.broker.issued(), "the Secret holds the kubeconfig: no fetch")
	s := getSecret(t, cs, "kargo", "east")
	require.Equal(t, "b", s.Labels["team"])
	require.Equal(t, leaseID(1), s.Annotations[config.AnnotationLeaseID])

	// The key renamed: nothing holds the kubeconfig under it any more, so a
	// new credential is fetched and the old lease retired.
	renamed := relabelled
	renamed.Key = "kubeconfig.yaml"
	g := newRefresherFixture(t, config.RefreshConfig{}, out(renamed))
	g.clock.SetTime(t0.Add(6 * time.Minute))
	g.r.step(ctx)
	require.Equal(t, 1, g.broker.issued())
	s = getSecret(t, cs, "kargo", "east")
	require.NotEmpty(t, s.Data["kubeconfig.yaml"])
	require.NotContains(t, s.Data, "kubeconfig")
	require.True(t, g.r.status().ready())

	// Unchanged settings: adopted as they are, nothing written.
	h := newRefresherFixture(t, config.RefreshConfig{}, out(renamed))
	h.clock.SetTime(t0.Add(7 * time.Minute))
	before := len(writeActions(cs))
	h.r.step(ctx)
	require.Zero(t, h.broker.issued())
	require.Equal(t, before, len(writeActions(cs)), "an unchanged output is adopted without a write")
}
