package broker

import (
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/yaml"
)

func TestKubeconfigMatchesClientcmd(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cluster ClusterSpec
		ns, sa  string
		token   string
	}{
		{name: "a typical kubeconfig", cluster: ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}, ns: "argo", sa: "runner", token: secretToken},
		{name: "values that YAML would otherwise misread stay strings", cluster: ClusterSpec{Name: "yes", Server: "https://[::1]:6443/path?q=1#x", CAData: "x"}, ns: "null", sa: "true", token: "1e3: # &a *b {c} \"d\" 'e' \\ \n\t"},
		{name: "non-ASCII and control characters survive", cluster: ClusterSpec{Name: "ö", Server: "https://\u00e9.example", CAData: "\x00\xff"}, ns: "a\u202eb", sa: "c\x01d", token: "\u2028"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := buildKubeconfig(tc.cluster, tc.ns, tc.sa, tc.token)
			require.NoError(t, err)

			// What client-go's own types and YAML encoder would write.
			user, ctx := tc.sa+"@"+tc.cluster.Name, tc.ns+"/"+tc.sa+"@"+tc.cluster.Name
			want, err := yaml.Marshal(clientcmdv1.Config{
				APIVersion: "v1", Kind: "Config",
				Clusters:       []clientcmdv1.NamedCluster{{Name: tc.cluster.Name, Cluster: clientcmdv1.Cluster{Server: tc.cluster.Server, CertificateAuthorityData: []byte(tc.cluster.CAData)}}},
				AuthInfos:      []clientcmdv1.NamedAuthInfo{{Name: user, AuthInfo: clientcmdv1.AuthInfo{Token: tc.token}}},
				Contexts:       []clientcmdv1.NamedContext{{Name: ctx, Context: clientcmdv1.Context{Cluster: tc.cluster.Name, AuthInfo: user, Namespace: tc.ns}}},
				CurrentContext: ctx,
			})
			require.NoError(t, err)
			gotCfg, err := clientcmd.Load(got)
			require.NoError(t, err, string(got))
			wantCfg, err := clientcmd.Load(want)
			require.NoError(t, err)
			require.Equal(t, wantCfg, gotCfg)
			require.Equal(t, tc.token, gotCfg.AuthInfos[user].Token)
		})
	}
}

func BenchmarkBuildKubeconfig(b *testing.B) {
	c := ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: string(make([]byte, 600))}
	for b.Loop() {
		_, _ = buildKubeconfig(c, "argo", "runner", secretToken)
	}
}
