package pki

import (
	"encoding/base64"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// jwtOf is a compact JWS of header and payload with a dummy signature.
func jwtOf(header, payload string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(header)) + "." + enc([]byte(payload)) + "." + enc([]byte("signature"))
}

// boundToken is the payload of a Secret-bound ServiceAccount token as the
// API server mints it.
const boundToken = `{"aud":["https://kubernetes.default.svc"],"exp":1764412345,"iat":1764411745,` +
	`"iss":"https://kubernetes.default.svc","jti":"2f7c1a4e-3b9d-4c55-8e2a-6f0d9b1c7e44",` +
	`"kubernetes.io":{"namespace":"bench","secret":{"name":"tokenbroker-lease-a","uid":"8a6f4c2e"},` +
	`"serviceaccount":{"name":"runner","uid":"1b3d5f7a"}},"nbf":1764411745,"sub":"system:serviceaccount:bench:runner"}`

func TestTokenIDReadsTheJTIAsGolangJWTDoes(t *testing.T) {
	t.Parallel()
	for name, tok := range map[string]string{
		"bound token":     jwtOf(`{"alg":"RS256","kid":"k"}`, boundToken),
		"no jti":          jwtOf(`{"alg":"RS256"}`, `{"sub":"x"}`),
		"escaped jti":     jwtOf(`{"alg":"RS256"}`, `{"jti":"a\u0062\"c"}`),
		"jti in a nested": jwtOf(`{"alg":"RS256"}`, `{"kubernetes.io":{"jti":"inner"},"jti":"outer"}`),
	} {
		t.Run(name, func(t *testing.T) {
			want, err := UnverifiedClaims(tok)
			require.NoError(t, err)
			got, err := TokenID(tok)
			require.NoError(t, err)
			require.Equal(t, want.ID, got)
		})
	}
	require.Equal(t, "2f7c1a4e-3b9d-4c55-8e2a-6f0d9b1c7e44", func() string {
		id, _ := TokenID(jwtOf(`{}`, boundToken))
		return id
	}())
}

func TestTokenIDRefusesWhatIsNoJWT(t *testing.T) {
	t.Parallel()
	enc := base64.RawURLEncoding.EncodeToString
	for name, tok := range map[string]string{
		"empty":             "",
		"one segment":       "abc",
		"two segments":      "a." + enc([]byte(`{"jti":"x"}`)),
		"four segments":     jwtOf(`{}`, `{"jti":"x"}`) + ".d",
		"padded payload":    "a." + base64.URLEncoding.EncodeToString([]byte(`{"jti":"x"}`)) + ".c",
		"payload no base64": "a.%%%.c",
		"payload an array":  "a." + enc([]byte(`["jti"]`)) + ".c",
		"jti a number":      jwtOf(`{}`, `{"jti":42}`),
		"trailing data":     jwtOf(`{}`, `{"jti":"x"} {}`),
		"too long":          jwtOf(`{}`, `{"jti":"x","pad":"`+strings.Repeat("a", MaxTokenBytes)+`"}`),
	} {
		t.Run(name, func(t *testing.T) {
			id, err := TokenID(tok)
			require.Error(t, err)
			require.Empty(t, id)
		})
	}
}

// FuzzTokenID: TokenID never panics, and wherever both it and golang-jwt's
// parser read a token, they read the same jti.
func FuzzTokenID(f *testing.F) {
	f.Add(jwtOf(`{"alg":"RS256","kid":"k"}`, boundToken))
	f.Add(jwtOf(`{}`, `{"jti":"a\u0062"}`))
	f.Add("a.b.c")
	f.Add("..")
	f.Fuzz(func(t *testing.T, tok string) {
		id, err := TokenID(tok)
		if err != nil {
			if id != "" {
				t.Fatal("an id with an error")
			}
			return
		}
		if claims, err := UnverifiedClaims(tok); err == nil && claims.ID != id {
			t.Fatalf("TokenID %q, golang-jwt %q", id, claims.ID)
		}
	})
}

func BenchmarkTokenID(b *testing.B) {
	tok := jwtOf(`{"alg":"RS256","kid":"k"}`, boundToken)
	b.Run("TokenID", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := TokenID(tok); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("golang-jwt", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := UnverifiedClaims(tok); err != nil {
				b.Fatal(err)
			}
		}
	})
}
