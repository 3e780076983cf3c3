package server

import (
	"crypto/ecdsa"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
)

// joinTokenFor signs, with ca's key, a join token for identity whose aud
// is audiences, as "pki join-token --audience" makes it.
func joinTokenFor(t *testing.T, ca *pki.CA, identity string, audiences ...string) string {
	t.Helper()
	keyPEM, err := ca.KeyPEM()
	require.NoError(t, err)
	key, err := pki.ParsePrivateKeyPEM(keyPEM)
	require.NoError(t, err)
	id := make([]byte, 16)
	_, err = rand.Read(id)
	require.NoError(t, err)
	now := time.Now()
	tok, err := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.RegisteredClaims{
		Issuer:    pki.JoinTokenIssuer,
		Subject:   identity,
		Audience:  audiences,
		ExpiresAt: jwt.NewNumericDate(now.Add(10 * time.Minute)),
		NotBefore: jwt.NewNumericDate(now),
		IssuedAt:  jwt.NewNumericDate(now),
		ID:        hex.EncodeToString(id),
	}).SignedString(key.(*ecdsa.PrivateKey))
	require.NoError(t, err)
	return tok
}

func TestAJoinTokenEnrollsOnlyAtTheBrokersItNames(t *testing.T) {
	t.Parallel()
	// Two brokers of one CA, told apart by their policies' cluster.name.
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "shared CA", Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	brokerNamed := func(name string) *harness {
		pol, err := policy.Parse([]byte("cluster: {name: " + name + ", server: 'https://" + name + ".example.com', caData: x}\n"))
		require.NoError(t, err)
		b, err := broker.New(broker.Config{
			Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(pol), Logger: zap.NewNop(),
			Namespace: "tokenbroker", Enrollment: enrollment.Config{CA: ca, Revocations: enrollment.StaticRevocationList(enrollment.NewDenyList(nil))},
		})
		require.NoError(t, err)
		return newHarnessWith(t, b)
	}
	east, south := brokerNamed("east"), brokerNamed("south")

	tests := []struct {
		name       string
		aud        []string
		east       int
		southAfter int // the same token replayed at south
	}{
		{name: "a token for east enrolls at east and is refused when replayed at south", aud: []string{"east"}, east: http.StatusCreated, southAfter: http.StatusUnauthorized},
		{name: "a token for south is refused at east", aud: []string{"south"}, east: http.StatusUnauthorized, southAfter: http.StatusCreated},
		{name: "an unbound token is refused by both brokers by default", aud: []string{pki.JoinTokenAudience}, east: http.StatusUnauthorized, southAfter: http.StatusUnauthorized},
		{name: "a token without aud is refused by both brokers", aud: nil, east: http.StatusUnauthorized, southAfter: http.StatusUnauthorized},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tok := joinTokenFor(t, ca, testIdentity, tc.aud...)
			rec := east.do(postCertificate(certBody(t, testIdentity), tok, true))
			require.Equal(t, tc.east, rec.Code, rec.Body.String())
			rec = south.do(postCertificate(certBody(t, testIdentity), tok, true))
			require.Equal(t, tc.southAfter, rec.Code, rec.Body.String())
		})
	}
}
