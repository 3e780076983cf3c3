package agent

import (
	"context"
	"crypto/x509"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// trustPKI is the operators' root (which may sign one level of sub-CAs), a
// sub-CA of it, and a partner's CA that the broker trusts for its clients
// only: the caBundle of a renewal answer is the broker's client-CA bundle.
type trustPKI struct {
	root, sub, partner *pki.CA
}

func newTrustPKI(t *testing.T, clock *fakeClock) trustPKI {
	t.Helper()
	root, err := pki.NewCA(pki.CAOptions{CommonName: "operators' root", Now: clock.Now, PathLen: 1})
	require.NoError(t, err)
	sub, err := root.NewIntermediate(pki.CAOptions{CommonName: "operators' sub-CA"})
	require.NoError(t, err)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner CA", Now: clock.Now})
	require.NoError(t, err)
	return trustPKI{root: root, sub: sub, partner: partner}
}

func pemOf(cas ...*pki.CA) string {
	var out []byte
	for _, ca := range cas {
		out = append(out, ca.CertPEM()...)
	}
	return string(out)
}

func TestRenewalKeepsOnlyTheCAsTheCurrentBundleVouchesFor(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		bundle  func(trustPKI) string
		want    func(trustPKI) []*x509.Certificate
		wantErr error
	}{
		{
			name:   "A partner CA beside the current CA is dropped.",
			bundle: func(p trustPKI) string { return pemOf(p.root, p.partner) },
			want:   func(p trustPKI) []*x509.Certificate { return []*x509.Certificate{p.root.Certificate()} },
		},
		{
			name:   "A sub-CA of the current CA is kept and the partner CA after it is dropped.",
			bundle: func(p trustPKI) string { return pemOf(p.partner, p.root, p.sub) },
			want: func(p trustPKI) []*x509.Certificate {
				return []*x509.Certificate{p.root.Certificate(), p.sub.Certificate()}
			},
		},
		{
			name:   "A current CA left out of the answer is dropped with it.",
			bundle: func(p trustPKI) string { return pemOf(p.sub, p.partner) },
			want:   func(p trustPKI) []*x509.Certificate { return []*x509.Certificate{p.sub.Certificate()} },
		},
		{
			name:    "An answer that holds no CA the agent trusts is refused.",
			bundle:  func(p trustPKI) string { return pemOf(p.partner) },
			wantErr: pki.ErrNoTrustedCA,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			clock := newFakeClock(t0)
			p := newTrustPKI(t, clock)
			kp, err := p.root.IssueClient(pki.ClientOptions{Identity: westID, Lifetime: 24 * time.Hour})
			require.NoError(t, err)
			cur, err := parseIdentity(kp.CertPEM, kp.KeyPEM, p.root.CertPEM())
			require.NoError(t, err)
			api := renewFunc(func(_ context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error) {
				csr, identity, err := pki.ParseCSRPEM(csrPEM)
				require.NoError(t, err)
				kp, err := p.root.SignClient(csr, identity, 24*time.Hour)
				require.NoError(t, err)
				return &apiv1.CertificateResponse{Certificate: string(kp.CertPEM), CABundle: tt.bundle(p)}, nil
			})

			next, _, err := renewIdentity(context.Background(), api, cur, cur.bundlePEM, clock.Now(), false)
			if tt.wantErr != nil {
				require.ErrorIs(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			got, err := pki.ParseCertificatesPEM(next.bundlePEM)
			require.NoError(t, err)
			require.Equal(t, tt.want(p), got)
		})
	}
}

func TestARenewedIdentityIsStoredWithoutThePartnerCAOfTheAnswer(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner CA", Now: f.clock.Now})
	require.NoError(t, err)
	f.r.api = renewFunc(func(_ context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error) {
		resp, err := f.pki.sign(csrPEM)
		require.NoError(t, err)
		resp.CABundle += string(partner.CertPEM())
		return resp, nil
	})
	ctx := context.Background()
	f.clock.SetTime(f.r.step(ctx))
	f.r.step(ctx)
	require.Equal(t, 1, f.calls, "renewed")

	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, f.pki.ca.BundlePEM(), stored.bundlePEM, "only the CA that was trusted already")
	require.Equal(t, f.pki.ca.BundlePEM(), f.r.holder.get().bundlePEM)
}

func TestANewCAWrittenToCaCrtOutOfBandIsKeptByTheNextRenewal(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	newCA, err := pki.NewCA(pki.CAOptions{CommonName: "new CA", Now: f.clock.Now})
	require.NoError(t, err)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner CA", Now: f.clock.Now})
	require.NoError(t, err)
	// Step 2 of "Rotating the CA": the operator writes both CAs to ca.crt
	// while the agent runs, and the broker hands out its whole bundle.
	both := append(newCA.CertPEM(), f.pki.ca.BundlePEM()...)
	require.NoError(t, os.WriteFile(f.store.dir.Bundle(), both, 0o644))
	f.r.api = renewFunc(func(_ context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error) {
		resp, err := f.pki.sign(csrPEM)
		require.NoError(t, err)
		resp.CABundle = string(both) + string(partner.CertPEM())
		return resp, nil
	})
	ctx := context.Background()
	f.clock.SetTime(f.r.step(ctx))
	f.r.step(ctx)
	require.Equal(t, 1, f.calls, "renewed")

	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, both, stored.bundlePEM)
	require.Equal(t, both, f.r.holder.get().bundlePEM, "in service for the next handshake")
}

// TestInBundleTrustModeARenewalAfterTheCAChangedKeepsTheNewCA is the last
// step of a rotation for an agent that trusts brokers through
// ClusterTrustBundles: the broker signs with the new CA alone, the bundles
// carry it, ca.crt still holds only the old one. The renewal answer's CAs
// are vouched for by the bundles, and the new CA is stored.
func TestInBundleTrustModeARenewalAfterTheCAChangedKeepsTheNewCA(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	newCA, err := pki.NewCA(pki.CAOptions{CommonName: "new CA", Now: f.clock.Now})
	require.NoError(t, err)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner CA", Now: f.clock.Now})
	require.NoError(t, err)
	f.r.api = renewFunc(func(_ context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error) {
		resp, err := (&testPKI{ca: newCA, clock: f.clock, lifetime: f.pki.lifetime}).sign(csrPEM)
		require.NoError(t, err)
		resp.CABundle = string(newCA.CertPEM()) + string(partner.CertPEM())
		return resp, nil
	})
	var trust *trustState
	f.r.trust = func() *trustState { return trust }
	ctx := context.Background()

	// Without the bundles' CAs in service (none read yet, or no trust), the
	// answer has nothing the agent trusts: refused, the old identity stays.
	trust = &trustState{err: errNoTrust}
	f.clock.SetTime(f.r.step(ctx))
	f.r.step(ctx)
	require.Equal(t, 0, f.calls)
	require.Equal(t, 1, f.r.failuresSoFar())

	st, err := newTrustState([]*x509.Certificate{newCA.Certificate()}, "")
	require.NoError(t, err)
	trust = st
	f.clock.SetTime(f.r.nextAttempt())
	f.r.step(ctx)
	require.Equal(t, 1, f.calls, "renewed")
	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, newCA.CertPEM(), stored.bundlePEM, "the new CA, not the partner CA")
	require.Equal(t, newCA.CertPEM(), f.r.holder.get().bundlePEM)
}
