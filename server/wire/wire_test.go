package wire

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

func TestNegotiate(t *testing.T) {
	t.Parallel()
	const j, y = apiv1.MediaTypeJSON, apiv1.MediaTypeYAML
	tests := []struct {
		name   string
		accept string
		want   string
		ok     bool
	}{
		{name: "A missing header means JSON.", accept: "", want: j, ok: true},
		{name: "A header of only commas means JSON.", accept: " , ,", want: j, ok: true},
		{name: "An unparsable header means JSON.", accept: "garbage", want: j, ok: true},
		{name: "*/* means JSON.", accept: "*/*", want: j, ok: true},
		{name: "application/* means JSON.", accept: "application/*", want: j, ok: true},
		{name: "application/yaml means YAML.", accept: "application/yaml", want: y, ok: true},
		{name: "Media types are case-insensitive.", accept: "Application/YAML", want: y, ok: true},
		{name: "An explicit YAML beats a wildcard of equal q.", accept: "application/yaml, */*", want: y, ok: true},
		{name: "An explicit JSON beats a wildcard of equal q.", accept: "*/*, application/json", want: j, ok: true},
		{name: "Both named with equal q means JSON.", accept: "application/yaml, application/json", want: j, ok: true},
		{name: "The higher q wins over specificity.", accept: "application/yaml;q=0.4, */*;q=0.5", want: j, ok: true},
		{name: "q-values with three decimals are compared.", accept: "application/json;q=0.501, application/yaml;q=0.502", want: y, ok: true},
		{name: "A specific q=0 excludes a type a wildcard allows.", accept: "application/yaml;q=0, */*", want: j, ok: true},
		{name: "Excluding both types is not acceptable.", accept: "application/json;q=0, application/yaml;q=0, */*", ok: false},
		{name: "text/html only is not acceptable.", accept: "text/html", ok: false},
		{name: "*/*;q=0 is not acceptable.", accept: "*/*;q=0", ok: false},
		{name: "An invalid q drops only its range.", accept: "application/json;q=2, application/yaml", want: y, ok: true},
		{name: "A NaN q drops its range.", accept: "application/yaml;q=NaN", want: j, ok: true},
		{name: "A q with four decimals drops its range.", accept: "application/yaml;q=0.1234, text/plain", ok: false},
		{name: "Parameters other than q are ignored.", accept: "application/yaml;charset=utf-8;q=0.9, application/json;q=0.1", want: y, ok: true},
		{name: "A subtype wildcard on any type is not a full wildcard.", accept: "*/yaml", want: j, ok: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, ok := Negotiate(tt.accept, j, y)
			require.Equal(t, tt.ok, ok)
			if tt.ok {
				require.Equal(t, tt.want, got)
			}
		})
	}
}

func TestDecodeStrict(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		body   string
		want   apiv1.KubeconfigRequest
		detail string
		fields []apiv1.FieldError
	}{
		{name: "A complete object decodes.", body: validBody, want: apiv1.KubeconfigRequest{
			Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h", MinTTL: "30m",
			Audiences: []string{"https://kubernetes.default.svc"}, Credential: "token",
		}},
		{name: "Surrounding whitespace is fine.", body: "\n {\"namespace\":\"a\"} \n", want: apiv1.KubeconfigRequest{Namespace: "a"}},
		{name: "An escaped known key is the known key.", body: `{"n\u0061mespace":"a"}`, want: apiv1.KubeconfigRequest{Namespace: "a"}},
		{name: "Null leaves a field empty.", body: `{"namespace":null}`, want: apiv1.KubeconfigRequest{}},
		{name: "An empty object decodes to the zero request.", body: `{}`, want: apiv1.KubeconfigRequest{}},
		{name: "An empty body is refused.", body: "", detail: "The request body is empty."},
		{name: "null is not an object.", body: "null", detail: "The request body must be a JSON object."},
		{name: "A string is not an object.", body: `"x"`, detail: "The request body must be a JSON object."},
		{name: "A syntax error is refused with its offset.", body: `{"namespace" "a"}`, detail: "The request body is not valid JSON (at byte 13)."},
		{name: "A truncated object is refused.", body: `{"namespace":"a"`, detail: "The request body is truncated JSON."},
		{name: "A trailing comma is refused.", body: `{"namespace":"a",}`, detail: "The request body is not valid JSON (at byte 17)."},
		{name: "Trailing data is refused.", body: `{"namespace":"a"} x`, detail: "The request body has data after the JSON object."},
		{name: "A second value is refused.", body: `{"namespace":"a"} {"namespace":"b"}`, detail: "The request body has data after the JSON object."},
		{name: "A key differing by case is unknown.", body: `{"NAMESPACE":"a"}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "NAMESPACE", Detail: "unknown field"}}},
		{name: "A key matching only under Unicode folding is unknown.", body: `{"ſerviceAccount":"a"}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "ſerviceAccount", Detail: "unknown field"}}},
		{name: "A long unknown key is shortened when echoed.", body: `{"` + strings.Repeat("k", 100) + `":1}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: strings.Repeat("k", 64) + "…", Detail: "unknown field"}}},
		{name: "An unknown key with a nested value is refused.", body: `{"namespace":"a","x":{"y":[1,{"z":2}]}}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "x", Detail: "unknown field"}}},
		{name: "A duplicate key is refused.", body: `{"ttl":"1h","ttl":"2h"}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "ttl", Detail: "duplicate field"}}},
		{name: "A duplicate key spelled with an escape is refused.", body: `{"ttl":"1h","\u0074tl":"2h"}`, detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "ttl", Detail: "duplicate field"}}},
		{name: "A number where a string belongs is refused.", body: `{"ttl":3600}`, detail: "The request is invalid.",
			fields: []apiv1.FieldError{{Field: "ttl", Detail: "must be a string"}}},
		{name: "An object where an array belongs is refused.", body: `{"audiences":{}}`, detail: "The request is invalid.",
			fields: []apiv1.FieldError{{Field: "audiences", Detail: "must be an array of strings"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var got apiv1.KubeconfigRequest
			err := decodeStrict([]byte(tt.body), &got)
			if tt.detail == "" {
				require.NoError(t, err)
				require.Equal(t, tt.want, got)
				return
			}
			var be *problem.Error
			require.ErrorAs(t, err, &be)
			require.Equal(t, problem.KindInvalid, be.Kind)
			require.Equal(t, tt.detail, be.Detail)
			require.Equal(t, tt.fields, be.Fields)
		})
	}
}

// validBody is a complete KubeconfigRequest.
const validBody = `{"namespace":"argo","serviceAccount":"admiralty-source","ttl":"2h","minTTL":"30m","audiences":["https://kubernetes.default.svc"],"credential":"token"}`
