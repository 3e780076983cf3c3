package kubeconfig

import (
	"flag"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdlatest "k8s.io/client-go/tools/clientcmd/api/latest"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"

	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/issuers"
)

// update rewrites the golden files in testdata/ from what the code writes:
// go test ./broker -run TestTheGoldenKubeconfig -update
var update = flag.Bool("update", false, "rewrite testdata/*.golden from what Build writes")

// goldenToken is the bearer token of the golden kubeconfigs.
const goldenToken = "eyJhbGciOiJSUzI1NiJ9.eyJqdGkiOiJqdGktNDIifQ.c2lnbmF0dXJlLXRoYXQtbXVzdC1uZXZlci1iZS1sb2dnZWQ"

func TestKubeconfigMatchesClientcmd(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cluster policy.ClusterSpec
		ns, sa  string
		token   string
	}{
		{name: "a typical kubeconfig", cluster: policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}, ns: "argo", sa: "runner", token: goldenToken},
		{name: "a TLS server name and an HTTP proxy are written when set", cluster: policy.ClusterSpec{Name: "east", Server: "https://10.0.0.1:6443", TLSServerName: "east.internal", ProxyURL: "http://proxy.example.com:3128", CAData: "x"}, ns: "argo", sa: "runner", token: goldenToken},
		{name: "a socks5 proxy behind a path-serving API server is written as given", cluster: policy.ClusterSpec{Name: "east", Server: "https://rancher.example.com/k8s/clusters/c-m-abc123", ProxyURL: "socks5://127.0.0.1:1080", CAData: "x"}, ns: "argo", sa: "runner", token: goldenToken},
		{name: "values that YAML would otherwise misread stay strings", cluster: policy.ClusterSpec{Name: "yes", Server: "https://[::1]:6443/path?q=1#x", TLSServerName: "null", ProxyURL: "http://p:1/#: &a *b", CAData: "x"}, ns: "null", sa: "true", token: "1e3: # &a *b {c} \"d\" 'e' \\ \n\t"},
		{name: "non-ASCII and control characters survive", cluster: policy.ClusterSpec{Name: "ö", Server: "https://\u00e9.example/a\u0085b", TLSServerName: "\u0085\u2029", ProxyURL: "http://\u2028\ufeff", CAData: "\x00\xff"}, ns: "a\u202eb", sa: "c\x01d", token: "\u2028"},
		{name: "characters YAML refuses or folds when raw are escaped", cluster: policy.ClusterSpec{Name: "e\x7f", Server: "https://e/\u0080\u009f", TLSServerName: "\ufffe", ProxyURL: "http://\uffff", CAData: "x"}, ns: "\u0085", sa: "\x7f\u0085\U0001F600", token: "a\u0085\u0085b"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Build(tc.cluster, tc.ns, tc.sa, issuers.Credential{Token: tc.token})
			require.NoError(t, err)

			// What client-go's own types hold, converted as clientcmd.Load
			// converts them. (Not through client-go's YAML writer: that one
			// writes U+0085 raw, and YAML reads it back as a space.)
			user, ctx := tc.sa+"@"+tc.cluster.Name, tc.ns+"/"+tc.sa+"@"+tc.cluster.Name
			want := clientcmdv1.Config{
				APIVersion: "v1", Kind: "Config",
				Clusters: []clientcmdv1.NamedCluster{{Name: tc.cluster.Name, Cluster: clientcmdv1.Cluster{
					Server: tc.cluster.Server, TLSServerName: tc.cluster.TLSServerName, ProxyURL: tc.cluster.ProxyURL,
					CertificateAuthorityData: []byte(tc.cluster.CAData),
				}}},
				AuthInfos:      []clientcmdv1.NamedAuthInfo{{Name: user, AuthInfo: clientcmdv1.AuthInfo{Token: tc.token}}},
				Contexts:       []clientcmdv1.NamedContext{{Name: ctx, Context: clientcmdv1.Context{Cluster: tc.cluster.Name, AuthInfo: user, Namespace: tc.ns}}},
				CurrentContext: ctx,
			}
			wantCfg := clientcmdapi.NewConfig()
			require.NoError(t, clientcmdlatest.Scheme.Convert(&want, wantCfg, nil))
			gotCfg, err := clientcmd.Load(got)
			require.NoError(t, err, string(got))
			require.Equal(t, wantCfg, gotCfg)
			require.Equal(t, tc.token, gotCfg.AuthInfos[user].Token)
			require.Equal(t, tc.cluster.Server, gotCfg.Clusters[tc.cluster.Name].Server)
			require.Equal(t, tc.cluster.TLSServerName, gotCfg.Clusters[tc.cluster.Name].TLSServerName)
			require.Equal(t, tc.cluster.ProxyURL, gotCfg.Clusters[tc.cluster.Name].ProxyURL)
		})
	}
}

func TestClientGoConnectsWithTheServerNameAndProxyOfTheKubeconfig(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cluster policy.ClusterSpec
	}{
		{name: "without a server name or proxy, client-go uses the server's host and the environment's proxy", cluster: policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: "x"}},
		{name: "an SNI router's name and an HTTP proxy are used", cluster: policy.ClusterSpec{Name: "east", Server: "https://10.0.0.1:6443", TLSServerName: "east.internal", ProxyURL: "http://proxy.example.com:3128", CAData: "x"}},
		{name: "an HTTPS proxy is used", cluster: policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", ProxyURL: "https://proxy.example.com", CAData: "x"}},
		{name: "a socks5 proxy is used", cluster: policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", ProxyURL: "socks5://127.0.0.1:1080", CAData: "x"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			kc, err := Build(tc.cluster, "argo", "runner", issuers.Credential{Token: goldenToken})
			require.NoError(t, err)
			rc, err := clientcmd.RESTConfigFromKubeConfig(kc)
			require.NoError(t, err)
			require.Equal(t, tc.cluster.Server, rc.Host)
			require.Equal(t, tc.cluster.TLSServerName, rc.TLSClientConfig.ServerName)
			if tc.cluster.ProxyURL == "" {
				require.Nil(t, rc.Proxy)
				return
			}
			require.NotNil(t, rc.Proxy)
			req, err := http.NewRequest(http.MethodGet, tc.cluster.Server, nil)
			require.NoError(t, err)
			proxy, err := rc.Proxy(req)
			require.NoError(t, err)
			require.Equal(t, tc.cluster.ProxyURL, proxy.String())
		})
	}
}

// TestTheGoldenKubeconfigIsWhatTheBrokerBuilds keeps testdata/*.golden
// equal to what the broker hands out, so that tests elsewhere (the agent's)
// can take them as the broker's real output.
func TestTheGoldenKubeconfigIsWhatTheBrokerBuilds(t *testing.T) {
	t.Parallel()
	const (
		caPEM = "-----BEGIN CERTIFICATE-----\nMIIBdGVzdCBjYQ==\n-----END CERTIFICATE-----\n"
		token = "eyJhbGciOiJSUzI1NiJ9.eyJpYXQiOjE4OTM1NTk0NDV9.c2ln"
	)
	east := policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: caPEM}
	sniProxy := east
	sniProxy.TLSServerName, sniProxy.ProxyURL = "east.internal", "http://proxy.example.com:3128"
	tests := []struct {
		name    string
		file    string
		cluster policy.ClusterSpec
	}{
		{name: "a plain kubeconfig", file: "kubeconfig.golden", cluster: east},
		{name: "a kubeconfig with a TLS server name and a proxy", file: "kubeconfig-sni-proxy.golden", cluster: sniProxy},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := Build(tc.cluster, "argo", "admiralty-source", issuers.Credential{Token: token})
			require.NoError(t, err)
			path := filepath.Join("testdata", tc.file)
			if *update {
				require.NoError(t, os.WriteFile(path, got, 0o644))
			}
			want, err := os.ReadFile(path)
			require.NoError(t, err, "run: go test ./broker -run TestTheGoldenKubeconfig -update")
			require.Equal(t, string(want), string(got),
				"%s is not what Build writes; if the change is meant, run: go test ./broker -run TestTheGoldenKubeconfig -update", path)

			cfg, err := clientcmd.Load(want)
			require.NoError(t, err)
			c := cfg.Clusters[tc.cluster.Name]
			require.NotNil(t, c)
			require.Equal(t, tc.cluster.Server, c.Server)
			require.Equal(t, tc.cluster.TLSServerName, c.TLSServerName)
			require.Equal(t, tc.cluster.ProxyURL, c.ProxyURL)
			require.Equal(t, caPEM, string(c.CertificateAuthorityData))
			require.Equal(t, token, cfg.AuthInfos[cfg.Contexts[cfg.CurrentContext].AuthInfo].Token)
		})
	}
}

func BenchmarkBuildKubeconfig(b *testing.B) {
	c := policy.ClusterSpec{Name: "east", Server: "https://east.example.com:6443", CAData: string(make([]byte, 600))}
	for b.Loop() {
		_, _ = Build(c, "argo", "runner", issuers.Credential{Token: goldenToken})
	}
}

// FuzzAValidPolicysClusterReadsBackFromItsKubeconfig: whatever cluster
// section a policy accepts, the kubeconfig written from it loads with
// clientcmd and names the same server, TLS server name and proxy.
func FuzzAValidPolicysClusterReadsBackFromItsKubeconfig(f *testing.F) {
	f.Add([]byte(policytest.Basic))
	f.Add([]byte("cluster: {name: east, server: \"https://east.example.com:6443/a\u0085b\", caData: x}\n"))
	f.Add([]byte(`cluster: {name: east, server: "https://10.0.0.1:6443/k8s", tlsServerName: east.internal, proxyURL: "socks5://proxy:1080", caData: x}` + "\n"))
	f.Add([]byte(`cluster: {name: "e a", server: "https://[::1]:6443", proxyURL: "http://u:p@proxy:3128", caData: x}` + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := policy.Parse(data)
		if err != nil {
			return
		}
		c := p.Cluster
		kc, err := Build(c, "argo", "runner", issuers.Credential{Token: "t"})
		require.NoError(t, err)
		cfg, err := clientcmd.Load(kc)
		require.NoError(t, err, string(kc))
		got := cfg.Clusters[c.Name]
		require.NotNil(t, got, string(kc))
		require.Equal(t, c.Server, got.Server)
		require.Equal(t, c.TLSServerName, got.TLSServerName)
		require.Equal(t, c.ProxyURL, got.ProxyURL)
	})
}
