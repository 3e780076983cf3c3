package pki

import (
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
)

const testIdentity = "spiffe://oc.example/cluster/west"

// testTokenID is a well-formed jti for hand-made tokens.
const testTokenID = "0123456789abcdef0123456789abcdef"

// validJoinClaims are the claims IssueJoinToken would make at testNow, for
// tokens the tests build by hand.
func validJoinClaims() jwt.MapClaims {
	return jwt.MapClaims{
		"iss": JoinTokenIssuer,
		"aud": []string{JoinTokenAudience},
		"sub": testIdentity,
		"iat": testNow.Unix(),
		"nbf": testNow.Unix(),
		"exp": testNow.Add(10 * time.Minute).Unix(),
		"jti": testTokenID,
	}
}

// signES256 signs claims with the CA's key, as IssueJoinToken does.
func signES256(t *testing.T, ca *CA, claims jwt.MapClaims) string {
	t.Helper()
	s, err := jwt.NewWithClaims(jwt.SigningMethodES256, claims).SignedString(ca.signer.(*ecdsa.PrivateKey))
	require.NoError(t, err)
	return s
}

// with returns a copy of the valid claims with changes; a nil value deletes
// the claim.
func with(changes map[string]any) jwt.MapClaims {
	c := validJoinClaims()
	for k, v := range changes {
		if v == nil {
			delete(c, k)
			continue
		}
		c[k] = v
	}
	return c
}

// mutateSegment decodes segment i of a JWT, changes it and re-encodes it.
func mutateSegment(t *testing.T, token string, i int, change func([]byte) []byte) string {
	t.Helper()
	parts := strings.Split(token, ".")
	require.Len(t, parts, 3)
	b, err := base64.RawURLEncoding.DecodeString(parts[i])
	require.NoError(t, err)
	parts[i] = base64.RawURLEncoding.EncodeToString(change(b))
	return strings.Join(parts, ".")
}

func TestIssueJoinToken(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	tests := []struct {
		name    string
		opts    JoinTokenOptions
		wantTTL time.Duration
		wantErr string
	}{
		{name: "A token is valid for ten minutes by default.", opts: JoinTokenOptions{Identity: testIdentity}, wantTTL: DefaultJoinTokenTTL},
		{name: "The TTL is taken from the options.", opts: JoinTokenOptions{Identity: testIdentity, TTL: 2 * time.Hour}, wantTTL: 2 * time.Hour},
		{name: "A TTL of exactly 24 hours is allowed.", opts: JoinTokenOptions{Identity: testIdentity, TTL: MaxJoinTokenTTL}, wantTTL: MaxJoinTokenTTL},
		{name: "A TTL over 24 hours is refused.", opts: JoinTokenOptions{Identity: testIdentity, TTL: MaxJoinTokenTTL + time.Second}, wantErr: "outside"},
		{name: "A negative TTL is refused.", opts: JoinTokenOptions{Identity: testIdentity, TTL: -time.Minute}, wantErr: "outside"},
		{name: "An identity that is not a cluster identity is refused.", opts: JoinTokenOptions{Identity: "spiffe://oc.example/ns/default"}, wantErr: "invalid cluster identity"},
		{name: "An empty identity is refused.", opts: JoinTokenOptions{}, wantErr: "invalid cluster identity"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			token, claims, err := ca.IssueJoinToken(tt.opts)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Empty(t, token)
				return
			}
			require.NoError(t, err)
			require.LessOrEqual(t, len(token), MaxJoinTokenBytes)
			require.Equal(t, tt.opts.Identity, claims.Identity)
			require.Regexp(t, `^[0-9a-f]{32}$`, claims.ID)
			require.Equal(t, testNow, claims.IssuedAt)
			require.Equal(t, testNow, claims.NotBefore)
			require.Equal(t, testNow.Add(tt.wantTTL), claims.ExpiresAt)

			got, err := NewJoinTokenVerifier([]*x509.Certificate{ca.Certificate()}, fixedNow).Verify(token)
			require.NoError(t, err)
			require.Equal(t, claims, got)

			// The header and claims are exactly the documented ones.
			parsed, _, err := jwt.NewParser().ParseUnverified(token, jwt.MapClaims{})
			require.NoError(t, err)
			require.Equal(t, map[string]any{"alg": "ES256", "typ": "JWT"}, parsed.Header)
			mc := parsed.Claims.(jwt.MapClaims)
			require.Equal(t, JoinTokenIssuer, mc["iss"])
			require.Equal(t, []any{JoinTokenAudience}, mc["aud"])
			require.Len(t, mc, 7, "iss, aud, sub, iat, nbf, exp and jti only")
		})
	}
}

func TestJoinTokenIDsAreRandomAndFromTheInjectedSource(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	seen := map[string]bool{}
	for range 32 {
		_, c, err := ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
		require.NoError(t, err)
		require.False(t, seen[c.ID], "jti repeated")
		seen[c.ID] = true
	}
	_, c, err := ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity, Rand: constReader(0xab)})
	require.NoError(t, err)
	require.Equal(t, strings.Repeat("ab", 16), c.ID)
	_, _, err = ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity, Rand: errReader{}})
	require.ErrorContains(t, err, "generate ID")
}

func TestIssueJoinTokenRefusesATokenThatOutlivesTheCA(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{Now: fixedNow, Lifetime: 5 * time.Minute})
	require.NoError(t, err)
	_, _, err = ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity, TTL: 10 * time.Minute})
	require.ErrorIs(t, err, ErrLifetimeExceedsCA)
}

func TestJoinTokenVerifier(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	other := newTestCA(t)
	pubDER, err := x509.MarshalPKIXPublicKey(ca.Certificate().PublicKey)
	require.NoError(t, err)
	pubPEM := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
	issued, _, err := ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
	require.NoError(t, err)

	hs256 := func(secret []byte) func(t *testing.T) string {
		return func(t *testing.T) string {
			s, err := jwt.NewWithClaims(jwt.SigningMethodHS256, validJoinClaims()).SignedString(secret)
			require.NoError(t, err)
			return s
		}
	}
	es256 := func(c jwt.MapClaims) func(t *testing.T) string {
		return func(t *testing.T) string { return signES256(t, ca, c) }
	}

	tests := []struct {
		name    string
		token   func(t *testing.T) string
		now     time.Time // zero: testNow
		wantErr string
	}{
		{name: "A token issued by the CA is accepted.", token: func(*testing.T) string { return issued }},
		{name: "A hand-made token with the right claims and key is accepted.", token: es256(validJoinClaims())},
		{name: "A token is accepted within the leeway after it expired.", token: func(*testing.T) string { return issued }, now: testNow.Add(10*time.Minute + JoinTokenLeeway/2)},
		{name: "A token is accepted within the leeway before its nbf.", token: func(*testing.T) string { return issued }, now: testNow.Add(-JoinTokenLeeway / 2)},
		{name: "A token whose audience is one of several is accepted.", token: es256(with(map[string]any{"aud": []string{"other", JoinTokenAudience}}))},
		{name: "An expired token is refused.", token: func(*testing.T) string { return issued }, now: testNow.Add(10*time.Minute + JoinTokenLeeway + time.Second), wantErr: "expired"},
		{name: "A token that is not valid yet is refused.", token: es256(with(map[string]any{"nbf": testNow.Add(time.Hour).Unix()})), wantErr: "not valid yet"},
		{name: "A token issued in the future is refused.", token: es256(with(map[string]any{"iat": testNow.Add(time.Hour).Unix()})), wantErr: "used before issued"},
		{name: "A token for another audience is refused.", token: es256(with(map[string]any{"aud": []string{"kubernetes"}})), wantErr: "aud"},
		{name: "A token without an audience is refused.", token: es256(with(map[string]any{"aud": nil})), wantErr: "aud"},
		{name: "A token from another issuer is refused.", token: es256(with(map[string]any{"iss": "someone-else"})), wantErr: "iss"},
		{name: "A token with alg none is refused.", token: func(t *testing.T) string {
			s, err := jwt.NewWithClaims(jwt.SigningMethodNone, validJoinClaims()).SignedString(jwt.UnsafeAllowNoneSignatureType)
			require.NoError(t, err)
			return s
		}, wantErr: "signing method none is invalid"},
		{name: "A token HMAC-signed with the CA public key (DER) as secret is refused.", token: hs256(pubDER), wantErr: "signing method HS256 is invalid"},
		{name: "A token HMAC-signed with the CA public key (PEM) as secret is refused.", token: hs256(pubPEM), wantErr: "signing method HS256 is invalid"},
		{name: "A token HMAC-signed with the CA certificate as secret is refused.", token: hs256(ca.CertPEM()), wantErr: "signing method HS256 is invalid"},
		{name: "A token signed ES384 is refused.", token: func(t *testing.T) string {
			// The header claims ES384; the signature does not matter.
			return mutateSegment(t, issued, 0, func([]byte) []byte { return []byte(`{"alg":"ES384","typ":"JWT"}`) })
		}, wantErr: "signing method ES384 is invalid"},
		{name: "A token with a tampered signature is refused.", token: func(t *testing.T) string {
			return mutateSegment(t, issued, 2, func(b []byte) []byte { b[10] ^= 0x01; return b })
		}, wantErr: "signature is invalid"},
		{name: "A token with a truncated signature is refused.", token: func(t *testing.T) string {
			return mutateSegment(t, issued, 2, func(b []byte) []byte { return b[:32] })
		}, wantErr: "signature is invalid"},
		{name: "A token with a tampered payload is refused.", token: func(t *testing.T) string {
			return mutateSegment(t, issued, 1, func(b []byte) []byte {
				return []byte(strings.Replace(string(b), "/cluster/west", "/cluster/east", 1))
			})
		}, wantErr: "signature is invalid"},
		{name: "A token signed by another CA is refused.", token: func(t *testing.T) string { return signES256(t, other, validJoinClaims()) }, wantErr: "signature is invalid"},
		{name: "A token without a jti is refused.", token: es256(with(map[string]any{"jti": nil})), wantErr: "jti"},
		{name: "A token with an empty jti is refused.", token: es256(with(map[string]any{"jti": ""})), wantErr: "jti"},
		{name: "A token whose jti is not 32 lowercase hex digits is refused.", token: es256(with(map[string]any{"jti": "../../secrets/x"})), wantErr: "jti"},
		{name: "A token without exp is refused.", token: es256(with(map[string]any{"exp": nil})), wantErr: "exp claim is required"},
		{name: "A token with a string exp is refused.", token: es256(with(map[string]any{"exp": "tomorrow"})), wantErr: "malformed"},
		{name: "A token valid for more than 24 hours is refused.", token: es256(with(map[string]any{"exp": testNow.Add(25 * time.Hour).Unix()})), wantErr: "exp more than"},
		{name: "A token whose sub is not a cluster identity is refused.", token: es256(with(map[string]any{"sub": "spiffe://oc.example/ns/kube-system/sa/admin"})), wantErr: "invalid cluster identity"},
		{name: "A token without sub is refused.", token: es256(with(map[string]any{"sub": nil})), wantErr: "invalid cluster identity"},
		{name: "An oversized token is refused before it is parsed.", token: es256(with(map[string]any{"pad": strings.Repeat("x", MaxJoinTokenBytes)})), wantErr: "limit 4096"},
		{name: "A token with base64 padding is refused.", token: func(*testing.T) string {
			parts := strings.Split(issued, ".")
			return parts[0] + "==." + parts[1] + "." + parts[2]
		}, wantErr: "malformed"},
		{name: "Garbage is refused.", token: func(*testing.T) string { return "not a token" }, wantErr: "malformed"},
		{name: "Garbage in three segments is refused.", token: func(*testing.T) string { return "a.b.c" }, wantErr: "malformed"},
		{name: "An empty token is refused.", token: func(*testing.T) string { return "" }, wantErr: "malformed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			now := tt.now
			if now.IsZero() {
				now = testNow
			}
			v := NewJoinTokenVerifier([]*x509.Certificate{ca.Certificate()}, func() time.Time { return now })
			token := tt.token(t)
			claims, err := v.Verify(token)
			if tt.wantErr == "" {
				require.NoError(t, err)
				require.Equal(t, testIdentity, claims.Identity)
				require.NotEmpty(t, claims.ID)
				return
			}
			require.ErrorIs(t, err, ErrInvalidJoinToken)
			require.ErrorContains(t, err, tt.wantErr)
			require.Equal(t, JoinTokenClaims{}, claims)
			if token != "" {
				require.NotContains(t, err.Error(), token, "the error must not leak the token")
				for _, part := range strings.Split(token, ".") {
					if len(part) > 8 {
						require.NotContains(t, err.Error(), part, "the error must not leak part of the token")
					}
				}
			}
		})
	}
}

func TestJoinTokenVerifierKeys(t *testing.T) {
	t.Parallel()
	oldCA, newCA := newTestCA(t), newTestCA(t)
	oldToken, _, err := oldCA.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
	require.NoError(t, err)
	newToken, _, err := newCA.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
	require.NoError(t, err)

	t.Run("During a rotation tokens of the old and the new CA are accepted.", func(t *testing.T) {
		t.Parallel()
		v := NewJoinTokenVerifier([]*x509.Certificate{newCA.Certificate(), oldCA.Certificate()}, fixedNow)
		_, err := v.Verify(oldToken)
		require.NoError(t, err)
		_, err = v.Verify(newToken)
		require.NoError(t, err)
	})
	t.Run("After a rotation tokens of the old CA are refused.", func(t *testing.T) {
		t.Parallel()
		v := NewJoinTokenVerifier([]*x509.Certificate{newCA.Certificate()}, fixedNow)
		_, err := v.Verify(oldToken)
		require.ErrorIs(t, err, ErrInvalidJoinToken)
	})
	t.Run("A verifier without keys refuses every token.", func(t *testing.T) {
		t.Parallel()
		v := NewJoinTokenVerifier(nil, fixedNow)
		_, err := v.Verify(newToken)
		require.ErrorIs(t, err, ErrInvalidJoinToken)
		require.ErrorContains(t, err, "no ECDSA P-256 CA key")
	})
	t.Run("An intermediate CA signs tokens and verifies them by its own certificate.", func(t *testing.T) {
		t.Parallel()
		_, inter := newTestIntermediate(t)
		token, _, err := inter.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
		require.NoError(t, err)
		_, err = NewJoinTokenVerifier([]*x509.Certificate{inter.Certificate()}, fixedNow).Verify(token)
		require.NoError(t, err)
	})
	t.Run("The verifier's clock defaults to the system clock.", func(t *testing.T) {
		t.Parallel()
		ca, err := NewCA(CAOptions{})
		require.NoError(t, err)
		token, _, err := ca.IssueJoinToken(JoinTokenOptions{Identity: testIdentity})
		require.NoError(t, err)
		_, err = NewJoinTokenVerifier([]*x509.Certificate{ca.Certificate()}, nil).Verify(token)
		require.NoError(t, err)
	})
}
