package server

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/server/wire"
)

func TestValidateKubeconfigRequest(t *testing.T) {
	t.Parallel()
	valid := func() apiv1.KubeconfigRequest {
		return apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"}
	}
	tests := []struct {
		name   string
		mutate func(*apiv1.KubeconfigRequest)
		fields []string // the fields reported, in order
	}{
		{name: "Namespace and service account alone are valid.", mutate: func(*apiv1.KubeconfigRequest) {}},
		{name: "Every optional field set within bounds is valid.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.TTL, r.MinTTL, r.Credential = "8760h", "10m", apiv1.CredentialToken
			r.Audiences = []string{"a", strings.Repeat("b", 256)}
		}},
		{name: "A client certificate names no ServiceAccount and may carry a CSR.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.ServiceAccount, r.Credential, r.CSR = "", apiv1.CredentialClientCertificate, "-----BEGIN CERTIFICATE REQUEST-----"
		}},
		{name: "A client certificate for a ServiceAccount is refused: its user is per lease.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.Credential = apiv1.CredentialClientCertificate
		}, fields: []string{"serviceAccount"}},
		{name: "A client certificate has no audiences.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.ServiceAccount, r.Credential, r.Audiences = "", apiv1.CredentialClientCertificate, []string{"a"}
		}, fields: []string{"audiences"}},
		{name: "A CSR is not for a direct token.", mutate: func(r *apiv1.KubeconfigRequest) { r.CSR, r.Access = "x", apiv1.AccessDirect }, fields: []string{"csr"}},
		{name: "A CSR with no access named waits for the grant's mode (the broker refuses it for a direct grant).", mutate: func(r *apiv1.KubeconfigRequest) { r.CSR = "x" }},
		{name: "A gateway lease may carry a CSR.", mutate: func(r *apiv1.KubeconfigRequest) { r.CSR, r.Access = "x", apiv1.AccessGateway }},
		{name: "An unknown access mode is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.Access = "proxy" }, fields: []string{"access"}},
		{name: "A gateway lease has no audiences.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.Access, r.Audiences = apiv1.AccessGateway, []string{"a"}
		}, fields: []string{"audiences"}},
		{name: "A gateway lease is no client certificate of the CSR API.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.Access, r.ServiceAccount, r.Credential = apiv1.AccessGateway, "", apiv1.CredentialClientCertificate
		}, fields: []string{"credential"}},
		{name: "A CSR over 16 KiB is refused before parsing.", mutate: func(r *apiv1.KubeconfigRequest) {
			r.ServiceAccount, r.Credential, r.CSR = "", apiv1.CredentialClientCertificate, strings.Repeat("a", 16<<10+1)
		}, fields: []string{"csr"}},
		{name: "A service account name with dots is a valid subdomain.", mutate: func(r *apiv1.KubeconfigRequest) { r.ServiceAccount = "a.b-c" }},
		{name: "A missing namespace is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.Namespace = "" }, fields: []string{"namespace"}},
		{name: "A namespace with a dot is not a label.", mutate: func(r *apiv1.KubeconfigRequest) { r.Namespace = "a.b" }, fields: []string{"namespace"}},
		{name: "A 64-character namespace is too long.", mutate: func(r *apiv1.KubeconfigRequest) { r.Namespace = strings.Repeat("a", 64) }, fields: []string{"namespace"}},
		{name: "A missing service account is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.ServiceAccount = "" }, fields: []string{"serviceAccount"}},
		{name: "A 254-character service account is too long.", mutate: func(r *apiv1.KubeconfigRequest) { r.ServiceAccount = strings.Repeat("a", 254) }, fields: []string{"serviceAccount"}},
		{name: "A service account with a slash is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.ServiceAccount = "../admin" }, fields: []string{"serviceAccount"}},
		{name: "A TTL that is not a duration is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = "1 day" }, fields: []string{"ttl"}},
		{name: "A TTL without a unit is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = "3600" }, fields: []string{"ttl"}},
		{name: "A zero TTL is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = "0s" }, fields: []string{"ttl"}},
		{name: "A negative TTL is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = "-1h" }, fields: []string{"ttl"}},
		{name: "A TTL over a year is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = "8761h" }, fields: []string{"ttl"}},
		{name: "A TTL string over 32 characters is invalid.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL = strings.Repeat("0", 31) + "1h" }, fields: []string{"ttl"}},
		{name: "An invalid minTTL is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.MinTTL = "soon" }, fields: []string{"minTTL"}},
		{name: "A minTTL longer than the TTL is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.TTL, r.MinTTL = "1h", "2h" }, fields: []string{"minTTL"}},
		{name: "A minTTL without a TTL is left to the policy default.", mutate: func(r *apiv1.KubeconfigRequest) { r.MinTTL = "2h" }},
		{name: "Seventeen audiences are too many.", mutate: func(r *apiv1.KubeconfigRequest) { r.Audiences = make([]string, 17) }, fields: []string{"audiences"}},
		{name: "An empty audience is reported by index.", mutate: func(r *apiv1.KubeconfigRequest) { r.Audiences = []string{"a", " "} }, fields: []string{"audiences[1]"}},
		{name: "An audience over 256 characters is reported by index.", mutate: func(r *apiv1.KubeconfigRequest) { r.Audiences = []string{strings.Repeat("a", 257)} }, fields: []string{"audiences[0]"}},
		{name: "An unknown credential kind is reported.", mutate: func(r *apiv1.KubeconfigRequest) { r.Credential = "password" }, fields: []string{"credential"}},
		{name: "Credential kinds are case-sensitive.", mutate: func(r *apiv1.KubeconfigRequest) { r.Credential = "Token" }, fields: []string{"credential"}},
		{name: "Several problems are all reported.", mutate: func(r *apiv1.KubeconfigRequest) {
			*r = apiv1.KubeconfigRequest{TTL: "x", MinTTL: "y", Credential: "z", Audiences: []string{""}}
		}, fields: []string{"namespace", "serviceAccount", "ttl", "minTTL", "audiences[0]", "credential"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			req := valid()
			tt.mutate(&req)
			var got []string
			for _, fe := range validateKubeconfigRequest(req) {
				require.NotEmpty(t, fe.Detail)
				got = append(got, fe.Field)
			}
			require.Equal(t, tt.fields, got)
		})
	}
}

// FuzzDecodeKubeconfigRequest feeds arbitrary bodies through the decoder and
// the validator. It must never panic, and a body it accepts must be one JSON
// object whose keys are exactly, and once each, the wire names.
func FuzzDecodeKubeconfigRequest(f *testing.F) {
	for _, seed := range []string{
		validBody,
		`{"namespace":"argo","serviceAccount":"sa"}`,
		`{"namespace":"argo","serviceAccount":"sa","ttl":"1h","minTTL":"2h"}`,
		`{"namespace":"argo","NameSpace":"kube-system"}`,
		`{"namespace":"a","namespace":"b"}`,
		`{"ſerviceAccount":"sa"}`,
		`{"audiences":[{"a":1}],"x":[[[]]]}`,
		`{"namespace":"a"}{"namespace":"b"}`,
		`{"ttl":"9223372036854775807ns"}`,
		`[]`, `null`, ``, `{`, `{"a":1e999}`, "{\"namespace\":\"\xff\"}",
	} {
		f.Add([]byte(seed))
	}
	known := wire.FieldNames(&apiv1.KubeconfigRequest{})
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest(http.MethodPost, "/v1/kubeconfigs", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Body = http.MaxBytesReader(httptest.NewRecorder(), r.Body, DefaultMaxBodyBytes)
		var req apiv1.KubeconfigRequest
		err := wire.DecodeJSON(r, DefaultMaxBodyBytes, &req)
		if err != nil {
			var be *problem.Error
			require.ErrorAs(t, err, &be)
			require.Contains(t, []problem.Kind{problem.KindInvalid, problem.KindTooLarge}, be.Kind)
			return
		}
		fields := validateKubeconfigRequest(req)
		for _, fe := range fields {
			require.NotEmpty(t, fe.Field)
			require.NotEmpty(t, fe.Detail)
		}

		// Accepted: independently, the body is one object with only known,
		// unique keys.
		dec := json.NewDecoder(bytes.NewReader(body))
		tok, err := dec.Token()
		require.NoError(t, err)
		require.Equal(t, json.Delim('{'), tok)
		seen := map[string]bool{}
		for dec.More() {
			tok, err := dec.Token()
			require.NoError(t, err)
			key := tok.(string)
			require.True(t, known[key], "accepted unknown field %q", key)
			require.False(t, seen[key], "accepted duplicate field %q", key)
			seen[key] = true
			var skip json.RawMessage
			require.NoError(t, dec.Decode(&skip))
		}
		_, err = dec.Token()
		require.NoError(t, err)
		require.False(t, dec.More())

		if len(fields) == 0 {
			require.NotEmpty(t, req.Namespace)
			require.NotEmpty(t, req.ServiceAccount)
		}
	})
}

// FuzzDecodeLivePodsReport feeds PUT /v1/peers/self/pods bodies through
// the server's decoder and the broker's check: whatever is accepted is at
// most workload.MaxLivePods distinct lower-case uids.
func FuzzDecodeLivePodsReport(f *testing.F) {
	for _, seed := range []string{
		`{"uids":[]}`,
		`{"uids":["7a1e2f3c-0000-4000-8000-000000000002"]}`,
		`{"uids":["7a1e2f3c-0000-4000-8000-000000000002","7a1e2f3c-0000-4000-8000-000000000002"]}`,
		`{"uids":["7A1E2F3C-0000-4000-8000-000000000002"]}`,
		`{"uids":null}`, `{"uids":[1]}`, `{"uids":["a"],"uids":["b"]}`, `{"UIDs":[]}`, `[]`, ``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest(http.MethodPut, "/v1/peers/self/pods", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		var report apiv1.LivePodsReport
		if err := wire.DecodeJSON(r, DefaultMaxBodyBytes, &report); err != nil {
			var be *problem.Error
			require.ErrorAs(t, err, &be)
			require.Contains(t, []problem.Kind{problem.KindInvalid, problem.KindTooLarge}, be.Kind)
			return
		}
		if workload.CheckLivePods(report.UIDs) != nil {
			return
		}
		require.LessOrEqual(t, len(report.UIDs), workload.MaxLivePods)
		seen := map[string]bool{}
		for _, u := range report.UIDs {
			require.Len(t, u, 36)
			require.Equal(t, strings.ToLower(u), u)
			require.False(t, seen[u], "accepted %s twice", u)
			seen[u] = true
		}
	})
}
