package execcred

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/pkg/apis/clientauthentication"
	"k8s.io/client-go/pkg/apis/clientauthentication/install"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// decodeLikeClientGo decodes a plugin's answer the way client-go's exec
// authenticator does (refreshCredsLocked: the UniversalDecoder of the
// configured version into the internal type, the version check, then its
// checks of the status), with strict decoding on top, so that a field
// client-go does not know is an error too.
func decodeLikeClientGo(t *testing.T, apiVersion string, data []byte) *clientauthentication.ExecCredential {
	t.Helper()
	scheme := runtime.NewScheme()
	install.Install(scheme)
	codecs := serializer.NewCodecFactory(scheme, serializer.EnableStrict)
	gv, err := schema.ParseGroupVersion(apiVersion)
	require.NoError(t, err)
	cred := &clientauthentication.ExecCredential{}
	_, gvk, err := codecs.UniversalDecoder(gv).Decode(data, nil, cred)
	require.NoError(t, err)
	require.Equal(t, gv, gvk.GroupVersion(), "client-go refuses an answer in another version than it asked for")
	require.NotNil(t, cred.Status, "client-go refuses an answer without status")
	require.False(t, cred.Status.Token == "" && cred.Status.ClientCertificateData == "" && cred.Status.ClientKeyData == "", "client-go wants a token or a certificate and key")
	require.Equal(t, cred.Status.ClientCertificateData == "", cred.Status.ClientKeyData == "", "client-go wants both the certificate and the key, or neither")
	return cred
}

func TestParseExecInfo(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, in string
		want     ExecInfo
		err      string
	}{
		{name: "client-go's v1 request without cluster information is read",
			in:   `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"interactive":false}}`,
			want: ExecInfo{APIVersion: APIVersionV1, FromClientGo: true}},
		{name: "a v1beta1 request is answered in v1beta1",
			in:   `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1beta1","spec":{"interactive":true}}`,
			want: ExecInfo{APIVersion: APIVersionV1beta1, Interactive: true, FromClientGo: true}},
		{name: "cluster information is read and unknown fields are ignored",
			in:   `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","certificate-authority-data":"AAAA","proxy-url":"http://p","config":null},"interactive":false,"future":1},"status":null}`,
			want: ExecInfo{APIVersion: APIVersionV1, FromClientGo: true, Cluster: &Cluster{Server: "https://x", CAData: []byte{0, 0, 0}}}},
		{name: "a ClusterProfile's exec extension is the plugin's target",
			in: `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1beta1","spec":{"cluster":{"server":"https://x","config":` +
				`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"batch","serviceAccount":"mk","ttl":"1h","audiences":["a"]}}}}`,
			want: ExecInfo{APIVersion: APIVersionV1beta1, FromClientGo: true, Cluster: &Cluster{Server: "https://x", Target: &PluginTarget{
				APIVersion: apiv1.PluginTargetAPIVersion, Kind: apiv1.PluginTargetKind, Broker: "https://b:8443", RequestSpec: apiv1.RequestSpec{Namespace: "batch", ServiceAccount: "mk", TTL: "1h", Audiences: []string{"a"}}}}}},
		{name: "a gateway target says so",
			in: `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://gw","config":` +
				`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"batch","serviceAccount":"mk","access":"gateway"}}}}`,
			want: ExecInfo{APIVersion: APIVersionV1, FromClientGo: true, Cluster: &Cluster{Server: "https://gw", Target: &PluginTarget{
				APIVersion: apiv1.PluginTargetAPIVersion, Kind: apiv1.PluginTargetKind, Broker: "https://b:8443", RequestSpec: apiv1.RequestSpec{Namespace: "batch", ServiceAccount: "mk", Access: apiv1.AccessGateway}}}}},
		{name: "an access mode the plugin does not know is refused",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","access":"tunnel"}}}}`,
			err: "spec.cluster.config: access must be direct or gateway"},
		{name: "an access mode of the wrong type is refused",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","access":1}}}}`,
			err: "spec.cluster.config: access must not be a JSON number"},
		{name: "a field of the wrong type is named",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":["n"]}}}}`,
			err: "spec.cluster.config: namespace must not be a JSON array"},
		{name: "a target with a field the plugin does not know is refused rather than half understood",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","server":"https://evil"}}}}`,
			err: `spec.cluster.config: unknown field "server": not in tokenbroker.io/v1 PluginTarget`},
		{name: "another plugin's config is refused",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"example.com/v1","kind":"Other","x":1}}}}`,
			err: `spec.cluster.config: "example.com/v1" "Other" is not a target this plugin reads (apiVersion tokenbroker.io/v1, kind PluginTarget)`},
		{name: "a target without broker or namespace is refused with both problems",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","config":{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"http://b"}}}}`,
			err: "broker must be an https:// URL\nnamespace is required"},
		{name: "a CA that is not base64 is refused",
			in:  `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://x","certificate-authority-data":"!!"}}}`,
			err: "spec.cluster.certificate-authority-data is not base64"},
		{name: "a request without kind or spec is accepted",
			in:   `{"apiVersion":"client.authentication.k8s.io/v1"}`,
			want: ExecInfo{APIVersion: APIVersionV1, FromClientGo: true}},
		{name: "v1alpha1, removed from client-go, is refused with the versions that work",
			in:  `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1alpha1"}`,
			err: `apiVersion "client.authentication.k8s.io/v1alpha1" is not supported: tokenbroker credential speaks client.authentication.k8s.io/v1 and client.authentication.k8s.io/v1beta1`},
		{name: "a request without apiVersion is refused",
			in: `{"kind":"ExecCredential"}`, err: "no apiVersion"},
		{name: "another kind is refused",
			in: `{"kind":"Pod","apiVersion":"client.authentication.k8s.io/v1"}`, err: `kind "Pod" is not ExecCredential`},
		{name: "something that is not JSON is refused without quoting it",
			in: `apiVersion: client.authentication.k8s.io/v1`, err: "not JSON (at byte 1)"},
		{name: "a JSON array is not a request",
			in: `[1]`, err: "not a JSON object"},
		{name: "interactive of the wrong type is refused",
			in: `{"apiVersion":"client.authentication.k8s.io/v1","spec":{"interactive":"yes"}}`, err: "spec.interactive must not be a JSON string"},
		{name: "a long apiVersion is cut in the message",
			in: `{"apiVersion":"` + strings.Repeat("v", 500) + `"}`, err: strings.Repeat("v", 64) + "…"},
		{name: "an input over the limit is refused before it is decoded",
			in: `{"apiVersion":"client.authentication.k8s.io/v1","pad":"` + strings.Repeat("x", MaxExecInfoBytes) + `"}`, err: "over the limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseExecInfo([]byte(tc.in))
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				require.Less(t, len(err.Error()), 300, "one short line")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestExecInfoFromEnv(t *testing.T) {
	t.Parallel()
	env := func(m map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
	}
	for _, tc := range []struct {
		name string
		env  map[string]string
		want ExecInfo
		err  string
	}{
		{name: "without KUBERNETES_EXEC_INFO a person ran the command, and the answer is v1",
			env: nil, want: ExecInfo{APIVersion: APIVersionV1}},
		{name: "an empty KUBERNETES_EXEC_INFO is taken as absent",
			env: map[string]string{ExecInfoEnv: " "}, want: ExecInfo{APIVersion: APIVersionV1}},
		{name: "client-go's request says the version",
			env:  map[string]string{ExecInfoEnv: `{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","spec":{"interactive":false}}`},
			want: ExecInfo{APIVersion: APIVersionV1beta1, FromClientGo: true}},
		{name: "a bad request names the variable",
			env: map[string]string{ExecInfoEnv: `{`}, err: "KUBERNETES_EXEC_INFO: not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := ExecInfoFromEnv(env(tc.env))
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestEncodeIsReadByClientGo(t *testing.T) {
	t.Parallel()
	exp := time.Date(2030, 1, 2, 3, 4, 5, 600_000_000, time.UTC)
	for _, tc := range []struct {
		name, apiVersion string
		status           Status
	}{
		{name: "a v1 answer with a token", apiVersion: APIVersionV1, status: Status{Token: "tok-SECRET", Expiration: exp}},
		{name: "a v1beta1 answer with a token", apiVersion: APIVersionV1beta1, status: Status{Token: "tok-SECRET", Expiration: exp}},
		{name: "a v1 answer with a certificate and its key", apiVersion: APIVersionV1,
			status: Status{ClientCertificateData: "CERT", ClientKeyData: "KEY-SECRET", Expiration: exp}},
		{name: "a v1beta1 answer with a certificate and its key", apiVersion: APIVersionV1beta1,
			status: Status{ClientCertificateData: "CERT", ClientKeyData: "KEY-SECRET", Expiration: exp}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data, err := Encode(tc.apiVersion, tc.status)
			require.NoError(t, err)
			require.True(t, strings.HasSuffix(string(data), "}\n"), "one document and a newline")
			cred := decodeLikeClientGo(t, tc.apiVersion, data)
			require.Equal(t, tc.status.Token, cred.Status.Token)
			require.Equal(t, tc.status.ClientCertificateData, cred.Status.ClientCertificateData)
			require.Equal(t, tc.status.ClientKeyData, cred.Status.ClientKeyData)
			require.NotNil(t, cred.Status.ExpirationTimestamp)
			require.True(t, exp.Truncate(time.Second).Equal(cred.Status.ExpirationTimestamp.Time), "whole seconds, as metav1.Time writes them")
		})
	}
}

func TestEncodeRefusesWhatClientGoWouldRefuse(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, apiVersion string
		status           Status
		err              string
	}{
		{name: "an empty status", apiVersion: APIVersionV1, err: "neither a token nor a certificate"},
		{name: "a certificate without its key", apiVersion: APIVersionV1, status: Status{ClientCertificateData: "CERT"}, err: "neither a token nor a certificate"},
		{name: "an unknown version", apiVersion: "client.authentication.k8s.io/v1alpha1", status: Status{Token: "t"}, err: "not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Encode(tc.apiVersion, tc.status)
			require.ErrorContains(t, err, tc.err)
		})
	}
}

func TestStatusNeverShowsItsSecrets(t *testing.T) {
	t.Parallel()
	s := Status{Token: "tok-SECRET", ClientKeyData: "KEY-SECRET", Expiration: time.Unix(0, 0)}
	for _, out := range []string{s.String(), s.GoString()} {
		require.NotContains(t, out, "SECRET")
	}
}
