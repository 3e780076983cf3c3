package server

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
)

// bundleOf is a trust bundle of fixed CAs.
type bundleOf []*pki.CA

func (b bundleOf) PEM() []byte {
	var out []byte
	for _, ca := range b {
		out = append(out, ca.BundlePEM()...)
	}
	return out
}

func (b bundleOf) Certificates() []*x509.Certificate {
	var out []*x509.Certificate
	for _, ca := range b {
		out = append(out, ca.Certificate())
	}
	return out
}

// The peer the policy names, and an identity it does not.
const removedIdentity = "spiffe://oc.example/cluster/gone"

func TestOnlyTheSigningCAsPeersRenewAndOnlyItsJoinTokensEnroll(t *testing.T) {
	t.Parallel()
	signing, err := pki.NewCA(pki.CAOptions{CommonName: "signing CA", Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner CA in the trust bundle", Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	pol, err := policy.Parse([]byte(`cluster: {name: east, server: 'https://east.example.com', caData: x}
peers:
  - name: west
    identity: ` + testIdentity + `
    grants: [{namespaces: [argo], serviceAccounts: [sa]}]
`))
	require.NoError(t, err)
	b, err := broker.New(broker.Config{
		Secrets:    fake.NewClientset().CoreV1(),
		Policy:     policy.NewStore(pol),
		Logger:     zap.NewNop(),
		Namespace:  "tokenbroker",
		Enrollment: enrollment.Config{CA: signing, Trust: bundleOf{signing, partner}, Revocations: enrollment.StaticRevocationList(enrollment.NewDenyList(nil))},
	})
	require.NoError(t, err)
	h := newHarnessWith(t, b)

	stateFor := func(ca *pki.CA, identity string) *tls.ConnectionState {
		kp, err := ca.IssueClient(pki.ClientOptions{Identity: identity, Lifetime: time.Hour})
		require.NoError(t, err)
		return &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true,
			PeerCertificates: []*x509.Certificate{kp.Cert}, VerifiedChains: [][]*x509.Certificate{{kp.Cert, ca.Certificate()}}}
	}
	renewal := func(ca *pki.CA, identity string) request {
		rq := postCertificate(certBody(t, identity), "", false)
		rq.tls = stateFor(ca, identity)
		return rq
	}
	enrollment := func(ca *pki.CA) request {
		// The token names this broker and carries the unbound audience
		// too, so that only its signer decides, whichever audience rule
		// the broker applies.
		tok := joinTokenFor(t, ca, testIdentity, "east", pki.JoinTokenAudience)
		return postCertificate(certBody(t, testIdentity), tok, true)
	}

	tests := []struct {
		name   string
		rq     func() request
		status int
		slug   string
	}{
		{name: "a peer whose certificate the signing CA issued renews", rq: func() request { return renewal(signing, testIdentity) }, status: http.StatusCreated},
		{name: "a peer whose certificate a partner CA of the trust bundle issued cannot renew", rq: func() request { return renewal(partner, testIdentity) }, status: http.StatusForbidden, slug: "forbidden"},
		{name: "an identity removed from the policy cannot renew", rq: func() request { return renewal(signing, removedIdentity) }, status: http.StatusForbidden, slug: "forbidden"},
		{name: "a join token of the signing CA enrolls", rq: func() request { return enrollment(signing) }, status: http.StatusCreated},
		{name: "a join token signed by a partner CA of the trust bundle is refused", rq: func() request { return enrollment(partner) }, status: http.StatusUnauthorized, slug: "unauthenticated"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rec := h.do(tc.rq())
			if tc.slug == "" {
				require.Equal(t, tc.status, rec.Code, rec.Body.String())
				return
			}
			requireProblem(t, rec, tc.status, tc.slug)
		})
	}
}
