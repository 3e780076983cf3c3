package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
)

const (
	testIssuer   = "https://kubernetes.default.svc.cluster.local"
	testAudience = "tokenbroker.east"
)

// workloadKeys is a peer cluster's signing key and its published set.
type workloadKeys struct {
	key  *ecdsa.PrivateKey
	kid  string
	jwks *JWKS
	raw  []byte
}

func newWorkloadKeys(t testing.TB) workloadKeys {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	kid, err := KubernetesKeyID(key.Public())
	require.NoError(t, err)
	raw, err := EncodeJWKS(map[string]crypto.PublicKey{kid: key.Public()})
	require.NoError(t, err)
	set, err := ParseJWKS(raw)
	require.NoError(t, err)
	return workloadKeys{key: key, kid: kid, jwks: set, raw: raw}
}

// workloadClaims are the claims of a projected token for argo/runner, as
// the API server writes them at testNow.
func workloadClaims() jwt.MapClaims {
	return jwt.MapClaims{
		"iss": testIssuer,
		"aud": []string{testAudience},
		"sub": "system:serviceaccount:argo:runner",
		"iat": testNow.Unix(),
		"nbf": testNow.Unix(),
		"exp": testNow.Add(10 * time.Minute).Unix(),
		"jti": "2b5f0c9e-4d1b-4b8e-9a43-8c1b5d0f6a7e",
		"kubernetes.io": map[string]any{
			"namespace":      "argo",
			"serviceaccount": map[string]any{"name": "runner", "uid": "7a1e2f3c-0000-4000-8000-000000000001"},
			"pod":            map[string]any{"name": "runner-abc", "uid": "7a1e2f3c-0000-4000-8000-000000000002"},
		},
	}
}

func (k workloadKeys) sign(t testing.TB, claims jwt.MapClaims) string {
	t.Helper()
	tok := jwt.NewWithClaims(jwt.SigningMethodES256, claims)
	tok.Header["kid"] = k.kid
	s, err := tok.SignedString(k.key)
	require.NoError(t, err)
	return s
}

func testWorkloadOptions() WorkloadTokenOptions {
	return WorkloadTokenOptions{Issuer: testIssuer, Audiences: []string{testAudience}, Now: fixedNow}
}

func TestVerifyWorkloadTokenAcceptsAProjectedToken(t *testing.T) {
	t.Parallel()
	k := newWorkloadKeys(t)
	c, err := VerifyWorkloadToken(k.sign(t, workloadClaims()), []*JWKS{k.jwks}, testWorkloadOptions())
	require.NoError(t, err)
	require.Equal(t, "argo", c.Namespace)
	require.Equal(t, "runner", c.ServiceAccount)
	require.Equal(t, "runner-abc", c.Pod)
	require.True(t, c.BoundToPod)
	require.Equal(t, k.kid, c.KeyID)
	require.Equal(t, "2b5f0c9e-4d1b-4b8e-9a43-8c1b5d0f6a7e", c.JTI)
}

func TestVerifyWorkloadTokenFindsTheKeyInTheSecondSet(t *testing.T) {
	t.Parallel()
	old, cur := newWorkloadKeys(t), newWorkloadKeys(t)
	_, err := VerifyWorkloadToken(old.sign(t, workloadClaims()), []*JWKS{cur.jwks, old.jwks}, testWorkloadOptions())
	require.NoError(t, err)
}

func TestVerifyWorkloadTokenRefusesHostileTokensWithTheirReason(t *testing.T) {
	t.Parallel()
	k := newWorkloadKeys(t)
	other := newWorkloadKeys(t)
	with := func(edit func(jwt.MapClaims)) string {
		c := workloadClaims()
		edit(c)
		return k.sign(t, c)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(k.key.Public())
	require.NoError(t, err)
	hs256 := func() string {
		tok := jwt.NewWithClaims(jwt.SigningMethodHS256, workloadClaims())
		tok.Header["kid"] = k.kid
		s, err := tok.SignedString(pubDER)
		require.NoError(t, err)
		return s
	}()
	none := func() string {
		tok := jwt.NewWithClaims(jwt.SigningMethodNone, workloadClaims())
		tok.Header["kid"] = k.kid
		s, err := tok.SignedString(jwt.UnsafeAllowNoneSignatureType)
		require.NoError(t, err)
		return s
	}()
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rs512 := func() string {
		tok := jwt.NewWithClaims(jwt.SigningMethodRS512, workloadClaims())
		tok.Header["kid"] = k.kid
		s, err := tok.SignedString(rsaKey)
		require.NoError(t, err)
		return s
	}()
	good := k.sign(t, workloadClaims())
	parts := strings.Split(good, ".")
	tampered := parts[0] + "." + base64.RawURLEncoding.EncodeToString([]byte(`{"iss":"x"}`)) + "." + parts[2]
	cases := []struct {
		name, token, reason string
		opts                func(*WorkloadTokenOptions)
	}{
		{name: "garbage is malformed", token: "not a token", reason: TokenMalformed},
		{name: "three parts of garbage are malformed", token: "a.b.c", reason: TokenMalformed},
		{name: "an oversized token is too large", token: strings.Repeat("a", MaxWorkloadTokenBytes+1), reason: TokenTooLarge},
		{name: "alg none is an unsupported algorithm", token: none, reason: TokenUnsupportedAlg},
		{name: "HS256 with the public key as secret is an unsupported algorithm", token: hs256, reason: TokenUnsupportedAlg},
		{name: "RS512 is an unsupported algorithm", token: rs512, reason: TokenUnsupportedAlg},
		{name: "a kid in no set is an unknown key", token: other.sign(t, workloadClaims()), reason: TokenUnknownKey},
		{name: "a changed payload has a bad signature", token: tampered, reason: TokenBadSignature},
		{name: "an expired token is expired", token: with(func(c jwt.MapClaims) {
			c["iat"], c["nbf"], c["exp"] = testNow.Add(-2*time.Hour).Unix(), testNow.Add(-2*time.Hour).Unix(), testNow.Add(-time.Hour).Unix()
		}), reason: TokenExpired},
		{name: "a token whose nbf is in the future is not yet valid", token: with(func(c jwt.MapClaims) {
			c["nbf"] = testNow.Add(5 * time.Minute).Unix()
		}), reason: TokenNotYetValid},
		{name: "a token issued in the future is not yet valid", token: with(func(c jwt.MapClaims) {
			c["iat"] = testNow.Add(5 * time.Minute).Unix()
		}), reason: TokenNotYetValid},
		{name: "another audience is the wrong audience", token: with(func(c jwt.MapClaims) {
			c["aud"] = []string{"https://kubernetes.default.svc.cluster.local"}
		}), reason: TokenWrongAudience},
		{name: "another issuer is the wrong issuer", token: with(func(c jwt.MapClaims) { c["iss"] = "https://east.example" }), reason: TokenWrongIssuer},
		{name: "a token without exp misses claims", token: with(func(c jwt.MapClaims) { delete(c, "exp") }), reason: TokenMissingClaims},
		{name: "a token without iat misses claims", token: with(func(c jwt.MapClaims) { delete(c, "iat") }), reason: TokenMissingClaims},
		{name: "a token without kubernetes.io claims misses claims", token: with(func(c jwt.MapClaims) { delete(c, "kubernetes.io") }), reason: TokenMissingClaims},
		{name: "a sub that names another ServiceAccount misses claims", token: with(func(c jwt.MapClaims) {
			c["sub"] = "system:serviceaccount:argo:admin"
		}), reason: TokenMissingClaims},
		{name: "a year-long token is too long-lived", token: with(func(c jwt.MapClaims) {
			c["exp"] = testNow.Add(365 * 24 * time.Hour).Unix()
		}), reason: TokenTooLongLived},
		{name: "a token without a pod is refused when pod binding is required", token: with(func(c jwt.MapClaims) {
			delete(c["kubernetes.io"].(map[string]any), "pod")
		}), reason: TokenPodBindingNeeded, opts: func(o *WorkloadTokenOptions) { o.RequirePodBinding = true }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o := testWorkloadOptions()
			if tc.opts != nil {
				tc.opts(&o)
			}
			_, err := VerifyWorkloadToken(tc.token, []*JWKS{k.jwks}, o)
			var te *WorkloadTokenError
			require.ErrorAs(t, err, &te)
			require.Equal(t, tc.reason, te.Reason, "%v", err)
			require.NotContains(t, err.Error(), tc.token, "the error must not echo the token")
		})
	}
}

func TestVerifyWorkloadTokenAllowsTheLeewayAndNoMore(t *testing.T) {
	t.Parallel()
	k := newWorkloadKeys(t)
	c := workloadClaims()
	c["iat"], c["nbf"], c["exp"] = testNow.Add(-20*time.Minute).Unix(), testNow.Add(-20*time.Minute).Unix(), testNow.Add(-WorkloadTokenLeeway+time.Second).Unix()
	_, err := VerifyWorkloadToken(k.sign(t, c), []*JWKS{k.jwks}, testWorkloadOptions())
	require.NoError(t, err)
	c["exp"] = testNow.Add(-WorkloadTokenLeeway - time.Second).Unix()
	_, err = VerifyWorkloadToken(k.sign(t, c), []*JWKS{k.jwks}, testWorkloadOptions())
	require.Error(t, err)
}

func TestParseJWKSRefusesUnusableSets(t *testing.T) {
	t.Parallel()
	k := newWorkloadKeys(t)
	ec := `"kty":"EC","crv":"P-256","x":"` + strings.Split(strings.Split(string(k.raw), `"x":"`)[1], `"`)[0] + `","y":"` + strings.Split(strings.Split(string(k.raw), `"y":"`)[1], `"`)[0] + `"`
	cases := []struct{ name, doc, want string }{
		{"an empty set has no keys", `{"keys":[]}`, "no keys"},
		{"not JSON is refused", `nope`, "not a JSON object"},
		{"trailing data is refused", string(k.raw) + `{}`, "after the JSON object"},
		{"a key without kid is refused", `{"keys":[{` + ec + `}]}`, "kid"},
		{"a duplicate kid is refused", `{"keys":[{"kid":"a",` + ec + `},{"kid":"a",` + ec + `}]}`, "duplicate kid"},
		{"a private key is refused", `{"keys":[{"kid":"a","d":"AAAA",` + ec + `}]}`, "private key"},
		{"an encryption key is refused", `{"keys":[{"kid":"a","use":"enc",` + ec + `}]}`, "use"},
		{"P-384 is refused", `{"keys":[{"kid":"a","kty":"EC","crv":"P-384","x":"AA","y":"AA"}]}`, "P-256"},
		{"a point off the curve is refused", `{"keys":[{"kid":"a","kty":"EC","crv":"P-256","x":"` + strings.Repeat("A", 43) + `","y":"` + strings.Repeat("A", 43) + `"}]}`, "not a point"},
		{"a short RSA key is refused", `{"keys":[{"kid":"a","kty":"RSA","n":"` + base64.RawURLEncoding.EncodeToString([]byte{0xc1, 2, 3, 4}) + `","e":"AQAB"}]}`, "bits"},
		{"an oct key is refused", `{"keys":[{"kid":"a","kty":"oct","k":"c2VjcmV0"}]}`, "kty"},
		{"too many keys are refused", `{"keys":[` + strings.Repeat(`{},`, MaxJWKSKeys) + `{}]}`, "over the limit"},
		{"an oversized document is refused", `{"keys":[],"pad":"` + strings.Repeat("a", MaxJWKSBytes) + `"}`, "over the limit"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := ParseJWKS([]byte(tc.doc))
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestJWKSDigestIgnoresFormattingButNotKeys(t *testing.T) {
	t.Parallel()
	a, b := newWorkloadKeys(t), newWorkloadKeys(t)
	again, err := ParseJWKS([]byte("\n  " + string(a.raw) + "\n"))
	require.NoError(t, err)
	require.Equal(t, a.jwks.Digest(), again.Digest())
	require.NotEqual(t, a.jwks.Digest(), b.jwks.Digest())
	require.Equal(t, []string{a.kid}, a.jwks.KeyIDs())
}

func TestEncodeJWKSRoundTripsRSAKeys(t *testing.T) {
	t.Parallel()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	raw, err := EncodeJWKS(map[string]crypto.PublicKey{"r": key.Public()})
	require.NoError(t, err)
	set, err := ParseJWKS(raw)
	require.NoError(t, err)
	got, alg, ok := set.Key("r")
	require.True(t, ok)
	require.Equal(t, "RS256", alg)
	require.True(t, key.PublicKey.Equal(got))
}
