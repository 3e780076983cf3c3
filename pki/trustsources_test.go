package pki

import (
	"crypto/x509"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMergeCABundles(t *testing.T) {
	t.Parallel()
	a, err := NewCA(CAOptions{Now: fixedNow, CommonName: "a"})
	require.NoError(t, err)
	b, err := NewCA(CAOptions{Now: fixedNow, CommonName: "b"})
	require.NoError(t, err)
	leaf, err := a.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)

	t.Run("the certificates of every bundle are merged once each, in order", func(t *testing.T) {
		t.Parallel()
		certs, skipped, err := MergeCABundles([][]byte{a.CertPEM(), append(b.CertPEM(), a.CertPEM()...)})
		require.NoError(t, err)
		require.Empty(t, skipped)
		require.Len(t, certs, 2)
		require.True(t, certs[0].Equal(a.Certificate()))
		require.True(t, certs[1].Equal(b.Certificate()))
	})
	t.Run("a bundle holding a certificate that is not a CA is skipped whole", func(t *testing.T) {
		t.Parallel()
		certs, skipped, err := MergeCABundles([][]byte{append(b.CertPEM(), leaf.CertPEM...), a.CertPEM()})
		require.NoError(t, err)
		require.Len(t, skipped, 1)
		require.ErrorContains(t, skipped[0], "bundle 0")
		require.ErrorContains(t, skipped[0], "not a CA")
		require.Len(t, certs, 1)
		require.True(t, certs[0].Equal(a.Certificate()))
	})
	t.Run("empty and malformed bundles are skipped and named", func(t *testing.T) {
		t.Parallel()
		certs, skipped, err := MergeCABundles([][]byte{nil, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), b.CertPEM()})
		require.NoError(t, err)
		require.Len(t, skipped, 2)
		require.ErrorContains(t, skipped[0], "bundle 0")
		require.ErrorContains(t, skipped[1], "bundle 1")
		require.Len(t, certs, 1)
	})
	t.Run("a bundle over the PEM size limit is skipped", func(t *testing.T) {
		t.Parallel()
		huge := make([]byte, MaxCertificatesPEMSize+1)
		_, skipped, err := MergeCABundles([][]byte{huge})
		require.NoError(t, err)
		require.Len(t, skipped, 1)
		require.True(t, errors.Is(skipped[0], ErrPEMTooLarge))
	})
	t.Run("more distinct CAs than MaxCertificates over all bundles is an error", func(t *testing.T) {
		t.Parallel()
		var bundles [][]byte
		for range MaxCertificates + 1 {
			ca, err := NewCA(CAOptions{Now: fixedNow, CommonName: "many"})
			require.NoError(t, err)
			bundles = append(bundles, ca.CertPEM())
		}
		certs, _, err := MergeCABundles(bundles)
		require.ErrorIs(t, err, ErrTooManyCertificates)
		require.Nil(t, certs)
	})
}

func TestPinnedCAs(t *testing.T) {
	t.Parallel()
	pinned, err := NewCA(CAOptions{Now: fixedNow, PathLen: 1, CommonName: "pinned"})
	require.NoError(t, err)
	inter, err := pinned.NewIntermediate(CAOptions{CommonName: "pinned intermediate"})
	require.NoError(t, err)
	attacker, err := NewCA(CAOptions{Now: fixedNow, CommonName: "attacker"})
	require.NoError(t, err)
	pin := Fingerprint(pinned.Certificate())

	t.Run("only the pinned CA and CAs it signed are kept", func(t *testing.T) {
		t.Parallel()
		kept, err := PinnedCAs([]*x509.Certificate{attacker.Certificate(), inter.Certificate(), pinned.Certificate()}, pin, fixedNow())
		require.NoError(t, err)
		require.Len(t, kept, 2)
		require.True(t, kept[0].Equal(pinned.Certificate()))
		require.True(t, kept[1].Equal(inter.Certificate()))
	})
	t.Run("certificates without the pinned CA are refused", func(t *testing.T) {
		t.Parallel()
		_, err := PinnedCAs([]*x509.Certificate{attacker.Certificate()}, pin, fixedNow())
		require.ErrorIs(t, err, ErrFingerprintMismatch)
		_, err = PinnedCAs(nil, pin, fixedNow())
		require.ErrorIs(t, err, ErrFingerprintMismatch)
	})
}

func TestValidSignerName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, signer string
		ok           bool
	}{
		{"a domain and a name are valid", "tokenbroker.io/east", true},
		{"a dotted name is valid", "tokenbroker.io/east.prod", true},
		{"no slash is refused", "tokenbroker.io", false},
		{"two slashes are refused", "tokenbroker.io/a/b", false},
		{"a one-label domain is refused", "tokenbroker/east", false},
		{"upper case is refused", "tokenbroker.io/East", false},
		{"a colon is refused", "tokenbroker.io/east:x", false},
		{"an empty name is refused", "", false},
		{"a name too long for the bundle's name is refused", "tokenbroker.io/" + strings.Repeat("a.", 120) + "b", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := ValidSignerName(tc.signer)
			if tc.ok {
				require.NoError(t, err)
				require.LessOrEqual(t, len(ClusterTrustBundleName(tc.signer)), 253)
			} else {
				require.Error(t, err)
			}
		})
	}
	require.Equal(t, "tokenbroker.io:east:trust-bundle", ClusterTrustBundleName("tokenbroker.io/east"))
}
