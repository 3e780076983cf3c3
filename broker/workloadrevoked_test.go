package broker

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// TestARevokedWorkloadIdentityRefusesItsTokensToo: a workload identity on
// the deny list (pki revoke --identity .../ns/<ns>/sa/<sa>) is refused
// whatever proves it; its ServiceAccount's tokens as well as its pod
// certificates. Other workloads of the peer are not.
func TestARevokedWorkloadIdentityRefusesItsTokensToo(t *testing.T) {
	t.Parallel()
	const west = "spiffe://oc.example/cluster/west"
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	kid, err := pki.KubernetesKeyID(key.Public())
	require.NoError(t, err)
	jwks, err := pki.EncodeJWKS(map[string]crypto.PublicKey{kid: key.Public()})
	require.NoError(t, err)
	token := func(sa string) string {
		now := time.Now()
		tok := jwt.NewWithClaims(jwt.SigningMethodES256, jwt.MapClaims{
			"iss": "https://west.example", "aud": []string{"tokenbroker.east"}, "sub": "system:serviceaccount:argo:" + sa,
			"iat": now.Unix(), "nbf": now.Unix(), "exp": now.Add(10 * time.Minute).Unix(),
			"kubernetes.io": map[string]any{"namespace": "argo", "serviceaccount": map[string]any{"name": sa, "uid": "7a1e2f3c-0000-4000-8000-000000000001"}},
		})
		tok.Header["kid"] = kid
		s, err := tok.SignedString(key)
		require.NoError(t, err)
		return s
	}
	env := newCertEnv(t, `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: `+west+`
    workloadIdentity: {issuer: "https://west.example", audiences: [tokenbroker.east], jwks: '`+string(jwks)+`'}
    grants: [{namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: runner}]}]
`, enrollment.RevocationEntry{Kind: enrollment.RevokeIdentity, Value: west + "/ns/argo/sa/runner"})
	caller := Caller{Identity: west}

	_, err = env.b.AuthenticateWorkload(context.Background(), caller, token("runner"))
	var pe *problem.Error
	require.True(t, errors.As(err, &pe), "%v", err)
	require.Equal(t, problem.KindBadWorkloadToken, pe.Kind)
	require.Equal(t, workload.TokenRevoked, pe.Reason)

	got, err := env.b.AuthenticateWorkload(context.Background(), caller, token("other"))
	require.NoError(t, err, "another workload of the peer")
	require.Equal(t, "argo/other", got.Workload.String())
}
