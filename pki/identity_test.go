package pki

import (
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestClusterIdentity(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		trustDomain string
		cluster     string
		want        string
	}{
		{name: "A dotted trust domain and a simple name make an identity.", trustDomain: "oc.example", cluster: "west", want: "spiffe://oc.example/cluster/west"},
		{name: "A single-label trust domain is allowed.", trustDomain: "local", cluster: "kind-1", want: "spiffe://local/cluster/kind-1"},
		{name: "Digits may start labels.", trustDomain: "1.example", cluster: "0east", want: "spiffe://1.example/cluster/0east"},
		{name: "A 63-character cluster name is allowed.", trustDomain: "oc.example", cluster: strings.Repeat("a", 63), want: "spiffe://oc.example/cluster/" + strings.Repeat("a", 63)},
		{name: "An empty trust domain is refused.", trustDomain: "", cluster: "west"},
		{name: "An upper-case trust domain is refused, not lowercased.", trustDomain: "OC.example", cluster: "west"},
		{name: "A trust domain with a port is refused.", trustDomain: "oc.example:443", cluster: "west"},
		{name: "A trust domain with an empty label is refused.", trustDomain: "oc..example", cluster: "west"},
		{name: "A trust domain ending in a dot is refused.", trustDomain: "oc.example.", cluster: "west"},
		{name: "A trust domain with an underscore is refused.", trustDomain: "oc_example", cluster: "west"},
		{name: "A trust domain longer than 253 characters is refused.", trustDomain: strings.Repeat(strings.Repeat("a", 50)+".", 5) + "abcd", cluster: "west"},
		{name: "An empty cluster name is refused.", trustDomain: "oc.example", cluster: ""},
		{name: "An upper-case cluster name is refused.", trustDomain: "oc.example", cluster: "West"},
		{name: "A cluster name with a dot is refused.", trustDomain: "oc.example", cluster: "west.1"},
		{name: "A cluster name starting with a hyphen is refused.", trustDomain: "oc.example", cluster: "-west"},
		{name: "A cluster name ending with a hyphen is refused.", trustDomain: "oc.example", cluster: "west-"},
		{name: "A cluster name with a slash is refused.", trustDomain: "oc.example", cluster: "west/x"},
		{name: "A 64-character cluster name is refused.", trustDomain: "oc.example", cluster: strings.Repeat("a", 64)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ClusterIdentity(tt.trustDomain, tt.cluster)
			if tt.want == "" {
				require.ErrorIs(t, err, ErrInvalidIdentity)
				require.Empty(t, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
			td, c, err := ParseIdentity(got)
			require.NoError(t, err)
			require.Equal(t, tt.trustDomain, td)
			require.Equal(t, tt.cluster, c)
		})
	}
}

func TestParseIdentity(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name        string
		id          string
		wantDomain  string
		wantCluster string
	}{
		{name: "A well-formed identity parses.", id: "spiffe://oc.example/cluster/west", wantDomain: "oc.example", wantCluster: "west"},
		{name: "An empty string is refused.", id: ""},
		{name: "Another scheme is refused.", id: "https://oc.example/cluster/west"},
		{name: "An upper-case scheme is refused.", id: "SPIFFE://oc.example/cluster/west"},
		{name: "A missing cluster segment is refused.", id: "spiffe://oc.example/west"},
		{name: "Another path kind is refused.", id: "spiffe://oc.example/ns/west"},
		{name: "A trailing slash is refused.", id: "spiffe://oc.example/cluster/west/"},
		{name: "An extra segment is refused.", id: "spiffe://oc.example/cluster/west/x"},
		{name: "A query is refused.", id: "spiffe://oc.example/cluster/west?x=1"},
		{name: "A fragment is refused.", id: "spiffe://oc.example/cluster/west#x"},
		{name: "User info is refused.", id: "spiffe://user@oc.example/cluster/west"},
		{name: "A port is refused.", id: "spiffe://oc.example:8443/cluster/west"},
		{name: "Percent-encoding is refused.", id: "spiffe://oc.example/cluster/w%65st"},
		{name: "A dot segment is refused.", id: "spiffe://oc.example/cluster/../cluster/west"},
		{name: "An upper-case trust domain is refused.", id: "spiffe://OC.example/cluster/west"},
		{name: "Whitespace is refused.", id: " spiffe://oc.example/cluster/west"},
		{name: "An over-long identity is refused.", id: "spiffe://oc.example/cluster/" + strings.Repeat("a", 3000)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			td, c, err := ParseIdentity(tt.id)
			if tt.wantDomain == "" {
				require.ErrorIs(t, err, ErrInvalidIdentity)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.wantDomain, td)
			require.Equal(t, tt.wantCluster, c)
		})
	}
}

func TestIdentityFromCert(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	// custom signs a certificate with whatever URIs the case needs.
	custom := func(t *testing.T, uris ...string) *x509.Certificate {
		t.Helper()
		tmpl := &x509.Certificate{Subject: pkix.Name{CommonName: "x"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
		for _, u := range uris {
			parsed, err := url.Parse(u)
			require.NoError(t, err)
			tmpl.URIs = append(tmpl.URIs, parsed)
		}
		kp, err := ca.issue(tmpl, 0, DefaultClientLifetime)
		require.NoError(t, err)
		return kp.Cert
	}
	tests := []struct {
		name    string
		cert    *x509.Certificate
		want    string
		wantErr string
	}{
		{name: "A client certificate yields its identity.", cert: issueClient(t, ca, "west").Cert, want: "spiffe://oc.example/cluster/west"},
		{name: "A certificate without a URI SAN is refused.", cert: issueServer(t, ca, "broker").Cert, wantErr: "0 URI SANs"},
		{name: "A certificate with two URI SANs is refused.", cert: custom(t, "spiffe://oc.example/cluster/west", "spiffe://oc.example/cluster/east"), wantErr: "2 URI SANs"},
		{name: "A certificate whose only URI SAN is not SPIFFE is refused.", cert: custom(t, "https://oc.example/cluster/west"), wantErr: "does not start with"},
		{name: "A certificate with a malformed SPIFFE URI is refused.", cert: custom(t, "spiffe://oc.example/cluster/west?admin=true"), wantErr: "DNS-1123"},
		{name: "A CA certificate is refused.", cert: ca.Certificate(), wantErr: "is a CA"},
		{name: "No certificate is refused.", cert: nil, wantErr: "no certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := IdentityFromCert(tt.cert)
			if tt.wantErr != "" {
				require.ErrorIs(t, err, ErrInvalidIdentity)
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

func TestFingerprintIsSHA256OfTheDER(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	sum := sha256.Sum256(ca.Certificate().Raw)
	fp := Fingerprint(ca.Certificate())
	require.Equal(t, "sha256:"+hex.EncodeToString(sum[:]), fp)
	require.Len(t, fp, len("sha256:")+64)
	require.Equal(t, strings.ToLower(fp), fp)
}
