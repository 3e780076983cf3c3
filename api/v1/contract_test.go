package v1

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

func TestADurationIsAGoDurationString(t *testing.T) {
	var d struct {
		TTL Duration `json:"ttl"`
	}
	require.NoError(t, json.Unmarshal([]byte(`{"ttl":"90m"}`), &d))
	require.Equal(t, Duration(90*time.Minute), d.TTL)
	out, err := json.Marshal(d)
	require.NoError(t, err)
	require.JSONEq(t, `{"ttl":"1h30m0s"}`, string(out))
	require.ErrorContains(t, json.Unmarshal([]byte(`{"ttl":60}`), &d), `must be a duration string such as "1h"`)
	require.ErrorContains(t, json.Unmarshal([]byte(`{"ttl":"forever"}`), &d), `must be a duration such as "1h"`)
}

func TestALeaseIDIs26CharactersOfLowercaseBase32(t *testing.T) {
	require.True(t, ValidLeaseID("q3fcxb7kumyz4pa2m6dxx5jnle"))
	for _, id := range []string{"", "abc", "Q3FCXB7KUMYZ4PA2M6DXX5JNLE", "q3fcxb7kumyz4pa2m6dxx5jnl1", "q3fcxb7kumyz4pa2m6dxx5jnlee", "../../../etc/passwd0000000"} {
		require.False(t, ValidLeaseID(id), id)
	}
}

func TestOneRequestValidatorReportsEveryProblemUnderItsPath(t *testing.T) {
	req := KubeconfigRequest{
		Namespace: "Not_A_NS", TTL: "2d", MinTTL: "3h",
		Audiences: []string{" ", string(make([]byte, MaxAudienceLen+1))}, Credential: "password",
	}
	got := FieldErrors(ValidateKubeconfigRequest(req, field.NewPath("targets[0]", "request")))
	fields := map[string]string{}
	for _, e := range got {
		fields[e.Field] = e.Detail
	}
	require.Len(t, got, 6, "%v", got)
	require.Contains(t, fields["targets[0].request.namespace"], "RFC 1123 label")
	require.Equal(t, "is required", fields["targets[0].request.serviceAccount"])
	require.Equal(t, `must be a duration such as "2h" or "90m"`, fields["targets[0].request.ttl"])
	require.Equal(t, "must not be empty", fields["targets[0].request.audiences[0]"])
	require.Equal(t, "must be at most 256 characters", fields["targets[0].request.audiences[1]"])
	require.Equal(t, `must be "token" or "clientCertificate"`, fields["targets[0].request.credential"])

	// minTTL longer than ttl is only judged when both parse.
	got = FieldErrors(ValidateKubeconfigRequest(KubeconfigRequest{Namespace: "ns", ServiceAccount: "sa", TTL: "1h", MinTTL: "2h"}, nil))
	require.Equal(t, []FieldError{{Field: "minTTL", Detail: "must not be longer than ttl"}}, got)
	require.Empty(t, ValidateKubeconfigRequest(KubeconfigRequest{Namespace: "ns", ServiceAccount: "sa"}, nil))
}
