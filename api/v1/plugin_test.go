package v1

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// A PluginTarget is read by plugins of other releases from the
// ClusterProfile entries the agent writes: its JSON keeps its names, its
// order and its omissions, and it carries the broker request it names.
func TestAPluginTargetIsReadAndWrittenWithTheSameJSON(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		raw  string
		want KubeconfigRequest
	}{
		{
			name: "a target with every field",
			raw:  `{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"batch","serviceAccount":"mk","ttl":"2h","minTTL":"1h","audiences":["a","b"],"credential":"clientCertificate","access":"gateway"}`,
			want: KubeconfigRequest{Namespace: "batch", ServiceAccount: "mk", TTL: "2h", MinTTL: "1h", Audiences: []string{"a", "b"}, Credential: CredentialClientCertificate, Access: AccessGateway},
		},
		{
			name: "a target with only what is required",
			raw:  `{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"batch"}`,
			want: KubeconfigRequest{Namespace: "batch"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dec := json.NewDecoder(bytes.NewReader([]byte(tc.raw)))
			dec.DisallowUnknownFields()
			var got PluginTarget
			require.NoError(t, dec.Decode(&got))
			require.Equal(t, PluginTargetAPIVersion, got.APIVersion)
			require.Equal(t, PluginTargetKind, got.Kind)
			require.Equal(t, "https://b:8443", got.Broker)
			require.Equal(t, tc.want, got.Request())
			out, err := json.Marshal(got)
			require.NoError(t, err)
			require.Equal(t, tc.raw, string(out))
		})
	}
}

// A CSR is made for each request from a new key: a target, which is
// asked again and again, never holds one.
func TestAPluginTargetHasNoCSR(t *testing.T) {
	t.Parallel()
	dec := json.NewDecoder(bytes.NewReader([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"batch","csr":"x"}`)))
	dec.DisallowUnknownFields()
	var got PluginTarget
	require.ErrorContains(t, dec.Decode(&got), `unknown field "csr"`)
}
