package main

import (
	"bytes"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

var pkiTestNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// runPKI runs `pki args...` in-process with a fixed clock and returns stderr,
// where the pki commands describe what they did.
func runPKI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	_, stderr, err := runPKIStreams(t, args...)
	return stderr, err
}

// runPKIStreams runs `pki args...` in-process with a fixed clock and returns
// stdout and stderr apart.
func runPKIStreams(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := newPKICommandWith(pkiEnv{now: func() time.Time { return pkiTestNow }, rand: rand.Reader})
	// As under the root command.
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err = cmd.Execute()
	return out.String(), errOut.String(), err
}

func readCert(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	data, err := os.ReadFile(file)
	require.NoError(t, err)
	certs, err := pki.ParseCertificatesPEM(data)
	require.NoError(t, err)
	require.Len(t, certs, 1)
	return certs[0]
}

func perm(t *testing.T, file string) os.FileMode {
	t.Helper()
	st, err := os.Stat(file)
	require.NoError(t, err)
	return st.Mode().Perm()
}

func verifyFromCA(t *testing.T, dir string, cert *x509.Certificate, usage x509.ExtKeyUsage) {
	t.Helper()
	pool, err := pki.LoadCertPool(filepath.Join(dir, "ca.crt"))
	require.NoError(t, err)
	_, err = cert.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{usage}, CurrentTime: pkiTestNow})
	require.NoError(t, err)
}

func TestPKICommands(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		setup   [][]string // commands run first; "DIR" is replaced by the temp dir
		args    []string
		wantErr string
		check   func(t *testing.T, dir, out string)
	}{
		{
			name: "init writes a five-year CA with a 0600 key and prints paths and fingerprint, not the key.",
			args: []string{"init", "--dir", "DIR"},
			check: func(t *testing.T, dir, out string) {
				cert := readCert(t, filepath.Join(dir, "ca.crt"))
				require.True(t, cert.IsCA)
				require.Equal(t, pki.DefaultCACommonName, cert.Subject.CommonName)
				require.Equal(t, pkiTestNow.Add(pki.DefaultCALifetime), cert.NotAfter)
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "ca.key")))
				require.Equal(t, os.FileMode(0o644), perm(t, filepath.Join(dir, "ca.crt")))
				require.Equal(t, os.FileMode(0o644), perm(t, filepath.Join(dir, "bundle.crt")))
				require.Equal(t, cert.Raw, readCert(t, filepath.Join(dir, "bundle.crt")).Raw, "the bundle is the CA")
				_, err := pki.LoadCA(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
				require.NoError(t, err)
				require.Contains(t, out, filepath.Join(dir, "ca.crt"))
				require.Contains(t, out, filepath.Join(dir, "ca.key"))
				require.Contains(t, out, pki.Fingerprint(cert))
				require.Contains(t, out, cert.NotAfter.Format(time.RFC3339))
				require.NotContains(t, out, "PRIVATE KEY")
			},
		},
		{
			name: "init takes the common name and a lifetime in days.",
			args: []string{"init", "--dir", "DIR", "--common-name", "east CA", "--lifetime", "30d"},
			check: func(t *testing.T, dir, _ string) {
				cert := readCert(t, filepath.Join(dir, "ca.crt"))
				require.Equal(t, "east CA", cert.Subject.CommonName)
				require.Equal(t, pkiTestNow.Add(30*24*time.Hour), cert.NotAfter)
			},
		},
		{
			name:    "init refuses to overwrite an existing CA and leaves it alone.",
			setup:   [][]string{{"init", "--dir", "DIR", "--common-name", "first"}},
			args:    []string{"init", "--dir", "DIR", "--common-name", "second"},
			wantErr: "use --force to overwrite",
			check: func(t *testing.T, dir, _ string) {
				require.Equal(t, "first", readCert(t, filepath.Join(dir, "ca.crt")).Subject.CommonName)
			},
		},
		{
			name:  "init with --force replaces an existing CA.",
			setup: [][]string{{"init", "--dir", "DIR", "--common-name", "first"}},
			args:  []string{"init", "--dir", "DIR", "--common-name", "second", "--force"},
			check: func(t *testing.T, dir, _ string) {
				require.Equal(t, "second", readCert(t, filepath.Join(dir, "ca.crt")).Subject.CommonName)
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "ca.key")))
			},
		},
		{
			name: "init creates a missing directory with mode 0700.",
			args: []string{"init", "--dir", "DIR/new/ca"},
			check: func(t *testing.T, dir, _ string) {
				require.Equal(t, os.FileMode(0o700), perm(t, filepath.Join(dir, "new", "ca")))
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "new", "ca", "ca.key")))
			},
		},
		{
			name:    "init without --dir is refused.",
			args:    []string{"init"},
			wantErr: `required flag(s) "dir" not set`,
		},
		{
			name:    "init with a malformed lifetime is refused.",
			args:    []string{"init", "--dir", "DIR", "--lifetime", "forever"},
			wantErr: "invalid argument",
		},
		{
			name:  "issue server writes a 90-day server certificate next to the CA by default.",
			setup: [][]string{{"init", "--dir", "DIR"}},
			args:  []string{"issue", "server", "--ca-dir", "DIR", "--dns", "broker.example,localhost", "--ip", "127.0.0.1"},
			check: func(t *testing.T, dir, out string) {
				cert := readCert(t, filepath.Join(dir, "server.crt"))
				require.Equal(t, []string{"broker.example", "localhost"}, cert.DNSNames)
				require.Len(t, cert.IPAddresses, 1)
				require.Equal(t, "127.0.0.1", cert.IPAddresses[0].String())
				require.Equal(t, pkiTestNow.Add(pki.DefaultServerLifetime), cert.NotAfter)
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "server.key")))
				verifyFromCA(t, dir, cert, x509.ExtKeyUsageServerAuth)
				require.Contains(t, out, filepath.Join(dir, "server.crt"))
				require.Contains(t, out, pki.Fingerprint(cert))
				require.Contains(t, out, "broker.example, localhost, 127.0.0.1")
				require.NotContains(t, out, "PRIVATE KEY")
			},
		},
		{
			name:    "issue server refuses to overwrite existing output files.",
			setup:   [][]string{{"init", "--dir", "DIR"}, {"issue", "server", "--ca-dir", "DIR", "--dns", "first"}},
			args:    []string{"issue", "server", "--ca-dir", "DIR", "--dns", "second"},
			wantErr: "use --force to overwrite",
			check: func(t *testing.T, dir, _ string) {
				require.Equal(t, []string{"first"}, readCert(t, filepath.Join(dir, "server.crt")).DNSNames)
			},
		},
		{
			name:  "issue server with --force overwrites existing output files.",
			setup: [][]string{{"init", "--dir", "DIR"}, {"issue", "server", "--ca-dir", "DIR", "--dns", "first"}},
			args:  []string{"issue", "server", "--ca-dir", "DIR", "--dns", "second", "--force"},
			check: func(t *testing.T, dir, _ string) {
				require.Equal(t, []string{"second"}, readCert(t, filepath.Join(dir, "server.crt")).DNSNames)
			},
		},
		{
			name:    "issue server without any name is refused.",
			setup:   [][]string{{"init", "--dir", "DIR"}},
			args:    []string{"issue", "server", "--ca-dir", "DIR"},
			wantErr: "at least one DNS name or IP address",
		},
		{
			name:    "issue server with a malformed IP address is refused.",
			setup:   [][]string{{"init", "--dir", "DIR"}},
			args:    []string{"issue", "server", "--ca-dir", "DIR", "--ip", "300.1.1.1"},
			wantErr: `invalid --ip "300.1.1.1"`,
		},
		{
			name:  "issue client writes a 30-day certificate for the cluster identity to CA-DIR/<cluster>.crt.",
			setup: [][]string{{"init", "--dir", "DIR"}},
			args:  []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example", "--cluster", "west"},
			check: func(t *testing.T, dir, out string) {
				cert := readCert(t, filepath.Join(dir, "west.crt"))
				id, err := pki.IdentityFromCert(cert)
				require.NoError(t, err)
				require.Equal(t, "spiffe://oc.example/cluster/west", id)
				require.Equal(t, pkiTestNow.Add(30*24*time.Hour), cert.NotAfter)
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "west.key")))
				verifyFromCA(t, dir, cert, x509.ExtKeyUsageClientAuth)
				require.Contains(t, out, id)
				require.Contains(t, out, pki.Fingerprint(cert))
				require.Contains(t, out, cert.NotAfter.Format(time.RFC3339))
				require.NotContains(t, out, "PRIVATE KEY")
			},
		},
		{
			name:  "issue client writes to the given output files with the given lifetime.",
			setup: [][]string{{"init", "--dir", "DIR"}},
			args: []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example", "--cluster", "east",
				"--out-cert", "DIR/out/tls.crt", "--out-key", "DIR/out/tls.key", "--lifetime", "12h"},
			check: func(t *testing.T, dir, _ string) {
				cert := readCert(t, filepath.Join(dir, "out", "tls.crt"))
				require.Equal(t, pkiTestNow.Add(12*time.Hour), cert.NotAfter)
				require.Equal(t, os.FileMode(0o600), perm(t, filepath.Join(dir, "out", "tls.key")))
				_, err := os.Stat(filepath.Join(dir, "east.crt"))
				require.ErrorIs(t, err, os.ErrNotExist)
			},
		},
		{
			name:    "issue client with an invalid cluster name is refused and writes nothing.",
			setup:   [][]string{{"init", "--dir", "DIR"}},
			args:    []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example", "--cluster", "West"},
			wantErr: "DNS-1123 label",
			check: func(t *testing.T, dir, _ string) {
				entries, err := os.ReadDir(dir)
				require.NoError(t, err)
				require.Len(t, entries, 4, "only ca.crt, ca.key, bundle.crt and out/")
			},
		},
		{
			name:    "issue client that would outlive the CA is refused.",
			setup:   [][]string{{"init", "--dir", "DIR", "--lifetime", "10d"}},
			args:    []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example", "--cluster", "west"},
			wantErr: "exceeds the CA's validity",
		},
		{
			name:    "issue without a CA is refused.",
			args:    []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example", "--cluster", "west"},
			wantErr: "no such file",
		},
		{
			name:    "issue client without --cluster is refused.",
			args:    []string{"issue", "client", "--ca-dir", "DIR", "--trust-domain", "oc.example"},
			wantErr: `required flag(s) "cluster" not set`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "out"), 0o755))
			subst := func(args []string) []string {
				out := make([]string, len(args))
				for i, a := range args {
					out[i] = strings.ReplaceAll(a, "DIR", dir)
				}
				return out
			}
			for _, s := range tt.setup {
				_, err := runPKI(t, subst(s)...)
				require.NoError(t, err)
			}
			out, err := runPKI(t, subst(tt.args)...)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
			} else {
				require.NoError(t, err)
			}
			if tt.check != nil {
				tt.check(t, dir, out)
			}
		})
	}
}

func TestPKIHelpDocumentsDefaults(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{name: "init help names the files, the key mode and the default lifetime.", args: []string{"init", "--help"}, want: []string{"ca.crt", "0600", "5 years", "--force"}},
		{name: "issue server help names the default files and lifetime.", args: []string{"issue", "server", "--help"}, want: []string{"CA-DIR/server.crt", "90 days", "--force"}},
		{name: "issue client help names the default files and lifetime.", args: []string{"issue", "client", "--help"}, want: []string{"CA-DIR/NAME.crt", "30 days", "spiffe://TD/cluster/NAME"}},
		{name: "init help describes the intermediate layout.", args: []string{"init", "--help"}, want: []string{"--intermediate", "root.key", "bundle.crt", "path length 1"}},
		{name: "join-token help says the token alone goes to stdout.", args: []string{"join-token", "--help"}, want: []string{"TOKEN=$(tokenbroker pki join-token", "10 minutes", "--ca-fingerprint", "--audience", "cluster.name", "--accept-unbound-join-tokens"}},
		{name: "bundle help describes a rotation.", args: []string{"bundle", "--help"}, want: []string{"--add", "rotation", "--out"}},
		{name: "inspect help names the JSON output.", args: []string{"inspect", "--help"}, want: []string{"-o json", "fingerprint"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			out, _, err := runPKIStreams(t, tt.args...)
			require.NoError(t, err)
			for _, w := range tt.want {
				require.Contains(t, out, w)
			}
		})
	}
}

func TestLifetimeFlagValue(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		in      string
		want    time.Duration
		wantErr bool
	}{
		{name: "Days are accepted.", in: "90d", want: 90 * 24 * time.Hour},
		{name: "Go durations are accepted.", in: "36h30m", want: 36*time.Hour + 30*time.Minute},
		{name: "Zero is refused.", in: "0s", wantErr: true},
		{name: "Negative days are refused.", in: "-1d", wantErr: true},
		{name: "Absurdly many days are refused.", in: "99999999d", wantErr: true},
		{name: "Fractional days are refused.", in: "1.5d", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var d durationValue
			err := d.Set(tt.in)
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, time.Duration(d))
		})
	}
}

func TestPKIInitWithClusterCAsMakesASigningCAThatSignsThem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		want []int // path lengths of ca.crt, then root.crt
	}{
		{name: "A root alone has path length 1.", args: []string{"--cluster-cas"}, want: []int{1}},
		{name: "With an intermediate, 1 and a root of 2.", args: []string{"--cluster-cas", "--intermediate"}, want: []int{1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			_, err := runPKI(t, append([]string{"init", "--dir", dir}, tc.args...)...)
			require.NoError(t, err)
			path := func(name string) string { return filepath.Join(dir, name) }
			require.Equal(t, tc.want[0], readCert(t, path("ca.crt")).MaxPathLen)
			if len(tc.want) > 1 {
				require.Equal(t, tc.want[1], readCert(t, path("root.crt")).MaxPathLen)
			}
			ca, err := pki.LoadCAChain(path("ca.crt"), path("ca.key"), path("bundle.crt"), pki.CAOptions{})
			require.NoError(t, err)
			require.NoError(t, ca.CheckSignsClusterCAs())
		})
	}

	// Without it, the signing CA cannot, and says how to make one that can.
	dir := t.TempDir()
	_, err := runPKI(t, "init", "--dir", dir, "--intermediate")
	require.NoError(t, err)
	ca, err := pki.LoadCA(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
	require.NoError(t, err)
	require.ErrorContains(t, ca.CheckSignsClusterCAs(), "pki init --cluster-cas")
}

func TestPKIInitWithIntermediate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	stdout, stderr, err := runPKIStreams(t, "init", "--dir", dir, "--intermediate", "--common-name", "east CA")
	require.NoError(t, err)
	require.Empty(t, stdout, "init describes what it wrote on stderr")
	require.NotContains(t, stderr, "PRIVATE KEY")
	path := func(name string) string { return filepath.Join(dir, name) }

	for _, tt := range []struct {
		file string
		mode os.FileMode
	}{
		{"root.crt", 0o644}, {"root.key", 0o600}, {"ca.crt", 0o644}, {"ca.key", 0o600}, {"bundle.crt", 0o644},
	} {
		require.Equal(t, tt.mode, perm(t, path(tt.file)), tt.file)
	}
	root := readCert(t, path("root.crt"))
	inter := readCert(t, path("ca.crt"))
	require.Equal(t, root.Raw, readCert(t, path("bundle.crt")).Raw, "the bundle is the root")
	require.Equal(t, "east CA root", root.Subject.CommonName)
	require.Equal(t, "east CA intermediate", inter.Subject.CommonName)
	require.True(t, root.IsCA)
	require.Equal(t, 1, root.MaxPathLen)
	require.True(t, inter.IsCA)
	require.Equal(t, 0, inter.MaxPathLen)
	require.True(t, inter.MaxPathLenZero)
	require.NoError(t, inter.CheckSignatureFrom(root))
	require.Contains(t, stderr, pki.Fingerprint(root))
	require.Contains(t, stderr, pki.Fingerprint(inter))
	require.Contains(t, stderr, "move it offline")

	// The intermediate loads with the plain LoadCA and, with the bundle,
	// knows its root.
	_, err = pki.LoadCA(path("ca.crt"), path("ca.key"))
	require.NoError(t, err)
	ca, err := pki.LoadCAChain(path("ca.crt"), path("ca.key"), path("bundle.crt"), pki.CAOptions{})
	require.NoError(t, err)
	require.Equal(t, inter.Raw, ca.Certificate().Raw)

	// `pki issue` signs with the intermediate and writes the chain.
	_, err = runPKI(t, "issue", "client", "--ca-dir", dir, "--trust-domain", "oc.example", "--cluster", "west")
	require.NoError(t, err)
	data, err := os.ReadFile(path("west.crt"))
	require.NoError(t, err)
	chain, err := pki.ParseCertificatesPEM(data)
	require.NoError(t, err)
	require.Len(t, chain, 2, "leaf and intermediate")
	require.Equal(t, inter.Raw, chain[1].Raw)
	pool, err := pki.LoadCertPool(path("bundle.crt"))
	require.NoError(t, err)
	intermediates := x509.NewCertPool()
	intermediates.AddCert(chain[1])
	_, err = chain[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: intermediates, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: pkiTestNow})
	require.NoError(t, err)

	// A second init refuses before writing anything.
	other := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(other, "root.key"), []byte("keep me"), 0o600))
	_, err = runPKI(t, "init", "--dir", other, "--intermediate")
	require.ErrorContains(t, err, "use --force to overwrite")
	entries, err := os.ReadDir(other)
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing was written")
}

func TestPKIInspect(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := runPKI(t, "init", "--dir", dir, "--intermediate")
	require.NoError(t, err)
	_, err = runPKI(t, "issue", "client", "--ca-dir", dir, "--trust-domain", "oc.example", "--cluster", "west")
	require.NoError(t, err)
	csrPEM, keyPEM, err := pki.NewCSR("spiffe://oc.example/cluster/east", nil)
	require.NoError(t, err)
	csrFile := filepath.Join(dir, "east.csr")
	require.NoError(t, os.WriteFile(csrFile, csrPEM, 0o644))
	keyFile := filepath.Join(dir, "east.key")
	require.NoError(t, os.WriteFile(keyFile, keyPEM, 0o600))
	data, err := os.ReadFile(filepath.Join(dir, "west.crt"))
	require.NoError(t, err)
	chain, err := pki.ParseCertificatesPEM(data)
	require.NoError(t, err)
	leaf, inter := chain[0], chain[1]

	t.Run("Text output describes every certificate of a chain.", func(t *testing.T) {
		t.Parallel()
		out, stderr, err := runPKIStreams(t, "inspect", filepath.Join(dir, "west.crt"))
		require.NoError(t, err)
		require.Empty(t, stderr)
		for _, want := range []string{
			"Certificate 1 of 2", "Certificate 2 of 2",
			"identity:       spiffe://oc.example/cluster/west",
			"URI:spiffe://oc.example/cluster/west",
			pki.Fingerprint(leaf), pki.Fingerprint(inter),
			"serial:         " + leaf.SerialNumber.Text(16),
			"expires in 30d 0h",
			"ECDSA P-256",
			"key usage:      digitalSignature",
			"ext key usage:  clientAuth",
			"CA:             no",
			"CA:             yes, path length 0",
			"issuer:         CN=tokenbroker CA intermediate",
		} {
			require.Contains(t, out, want)
		}
		require.NotContains(t, out, "PRIVATE KEY")
	})
	t.Run("JSON output parses and carries the identity and fingerprints.", func(t *testing.T) {
		t.Parallel()
		out, _, err := runPKIStreams(t, "inspect", "-o", "json", filepath.Join(dir, "west.crt"))
		require.NoError(t, err)
		var descs []pki.Description
		require.NoError(t, json.Unmarshal([]byte(out), &descs))
		require.Len(t, descs, 2)
		require.Equal(t, "certificate", descs[0].Type)
		require.Equal(t, "spiffe://oc.example/cluster/west", descs[0].Identity)
		require.Equal(t, pki.Fingerprint(leaf), descs[0].Fingerprint)
		require.Equal(t, []string{"clientAuth"}, descs[0].ExtKeyUsage)
		require.Equal(t, leaf.NotAfter.UTC(), *descs[0].NotAfter)
		require.Equal(t, int64(30*24*time.Hour/time.Second), *descs[0].ExpiresIn)
		require.True(t, descs[1].IsCA)
		require.Equal(t, 0, *descs[1].MaxPathLen)
		require.Equal(t, pki.Fingerprint(inter), descs[1].Fingerprint)
	})
	t.Run("The root shows as a self-signed CA with path length 1.", func(t *testing.T) {
		t.Parallel()
		out, _, err := runPKIStreams(t, "inspect", filepath.Join(dir, "bundle.crt"))
		require.NoError(t, err)
		require.Contains(t, out, "CA:             yes, path length 1, self-signed root")
		require.Contains(t, out, "key usage:      keyCertSign, cRLSign")
	})
	t.Run("A CSR is described with the broker's verdict.", func(t *testing.T) {
		t.Parallel()
		out, _, err := runPKIStreams(t, "inspect", csrFile)
		require.NoError(t, err)
		require.Contains(t, out, "Certificate request")
		require.Contains(t, out, "identity:       spiffe://oc.example/cluster/east")
		require.Contains(t, out, "enrollment:     accepted for spiffe://oc.example/cluster/east")
		out, _, err = runPKIStreams(t, "inspect", "-o", "json", csrFile)
		require.NoError(t, err)
		var descs []pki.Description
		require.NoError(t, json.Unmarshal([]byte(out), &descs))
		require.Len(t, descs, 1)
		require.Equal(t, "certificateRequest", descs[0].Type)
		require.Empty(t, descs[0].EnrollmentError)
	})
	t.Run("A key file is refused without printing it.", func(t *testing.T) {
		t.Parallel()
		out, stderr, err := runPKIStreams(t, "inspect", keyFile)
		require.ErrorContains(t, err, "private key")
		require.NotContains(t, out+stderr+err.Error(), strings.TrimSpace(string(keyPEM))[30:60])
	})
	t.Run("Garbage and unknown output formats are refused.", func(t *testing.T) {
		t.Parallel()
		_, err := runPKI(t, "inspect", filepath.Join(dir, "missing.crt"))
		require.ErrorContains(t, err, "no such file")
		_, err = runPKI(t, "inspect", "-o", "yaml", filepath.Join(dir, "west.crt"))
		require.ErrorContains(t, err, "-o must be text or json")
	})
}

func TestPKIJoinToken(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		init []string
	}{
		{name: "A join token from a root CA verifies against the CA and names its fingerprint.", init: []string{"init"}},
		{name: "A join token from an intermediate verifies against the intermediate and names the root's fingerprint.", init: []string{"init", "--intermediate"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			_, err := runPKI(t, append(tt.init, "--dir", dir)...)
			require.NoError(t, err)
			stdout, stderr, err := runPKIStreams(t, "join-token", "--ca-dir", dir, "--trust-domain", "oc.example", "--cluster", "west", "--ttl", "15m",
				"--audience", "east", "--audience", "east-2")
			require.NoError(t, err)

			require.True(t, strings.HasSuffix(stdout, "\n"))
			token := strings.TrimSuffix(stdout, "\n")
			require.NotContains(t, token, "\n", "stdout is exactly one line")
			require.Regexp(t, `^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$`, token)
			require.NotContains(t, stderr, token, "the token is printed on stdout only")

			signer := readCert(t, filepath.Join(dir, "ca.crt"))
			claims, err := pki.NewJoinTokenVerifierFor([]*x509.Certificate{signer}, []string{"east-2"}, func() time.Time { return pkiTestNow }).Verify(token)
			require.NoError(t, err)
			require.Equal(t, []string{"east", "east-2"}, claims.Audiences, "the token names the brokers it is for")
			require.Contains(t, stderr, "for brokers:    east, east-2")
			_, err = pki.NewJoinTokenVerifierFor([]*x509.Certificate{signer}, []string{"south"}, func() time.Time { return pkiTestNow }).Verify(token)
			require.ErrorIs(t, err, pki.ErrInvalidJoinToken, "a broker the token does not name refuses it")
			require.Equal(t, "spiffe://oc.example/cluster/west", claims.Identity)
			require.Equal(t, pkiTestNow.Add(15*time.Minute), claims.ExpiresAt)

			root := readCert(t, filepath.Join(dir, "bundle.crt"))
			require.Contains(t, stderr, "spiffe://oc.example/cluster/west")
			require.Contains(t, stderr, claims.ID)
			require.Contains(t, stderr, claims.ExpiresAt.Format(time.RFC3339))
			require.Contains(t, stderr, "--ca-fingerprint "+pki.Fingerprint(root))
			bundle, err := os.ReadFile(filepath.Join(dir, "bundle.crt"))
			require.NoError(t, err)
			require.NoError(t, pki.VerifyBundleFingerprint(bundle, pki.Fingerprint(root)), "the pinned fingerprint matches the served bundle")
		})
	}

	t.Run("Bad arguments are refused and nothing is printed on stdout.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		_, err := runPKI(t, "init", "--dir", dir)
		require.NoError(t, err)
		for _, tc := range []struct {
			args    []string
			wantErr string
		}{
			{[]string{"--ttl", "25h"}, "outside"},
			{[]string{"--ttl", "-1m"}, "outside"},
			{[]string{"--cluster", "West"}, "DNS-1123 label"},
			{[]string{"--audience", "tokenbroker-enrollment"}, "unbound token"},
			{[]string{"--audience", "east west"}, "without spaces"},
		} {
			args := append([]string{"join-token", "--ca-dir", dir, "--trust-domain", "oc.example", "--cluster", "west", "--audience", "east"}, tc.args...)
			stdout, _, err := runPKIStreams(t, args...)
			require.ErrorContains(t, err, tc.wantErr)
			require.Empty(t, stdout)
		}
		stdout, _, err := runPKIStreams(t, "join-token", "--ca-dir", filepath.Join(dir, "missing"), "--trust-domain", "oc.example", "--cluster", "west", "--audience", "east")
		require.ErrorContains(t, err, "no such file")
		require.Empty(t, stdout)
		stdout, _, err = runPKIStreams(t, "join-token", "--ca-dir", dir, "--trust-domain", "oc.example", "--cluster", "west")
		require.ErrorContains(t, err, `required flag(s) "audience" not set`, "a token names its broker")
		require.Empty(t, stdout)
	})
}

func TestPKIBundle(t *testing.T) {
	t.Parallel()
	oldDir, newDir := t.TempDir(), t.TempDir()
	_, err := runPKI(t, "init", "--dir", oldDir)
	require.NoError(t, err)
	_, err = runPKI(t, "init", "--dir", newDir, "--intermediate")
	require.NoError(t, err)
	oldCA := readCert(t, filepath.Join(oldDir, "ca.crt"))
	newRoot := readCert(t, filepath.Join(newDir, "root.crt"))

	t.Run("Adding the old CA gives both CAs once each, new first, in the --out file.", func(t *testing.T) {
		t.Parallel()
		out := filepath.Join(t.TempDir(), "client-ca.crt")
		// The old CA is given twice, as a file and inside the same file again.
		stdout, stderr, err := runPKIStreams(t, "bundle", "--ca-dir", newDir,
			"--add", filepath.Join(oldDir, "bundle.crt"), "--add", filepath.Join(oldDir, "ca.crt"), "--add", filepath.Join(newDir, "root.crt"), "--out", out)
		require.NoError(t, err)
		require.Empty(t, stdout)
		data, err := os.ReadFile(out)
		require.NoError(t, err)
		certs, err := pki.ParseCertificatesPEM(data)
		require.NoError(t, err)
		require.Len(t, certs, 2)
		require.Equal(t, newRoot.Raw, certs[0].Raw)
		require.Equal(t, oldCA.Raw, certs[1].Raw)
		require.Equal(t, os.FileMode(0o644), perm(t, out))
		require.Contains(t, stderr, pki.Fingerprint(newRoot))
		require.Contains(t, stderr, pki.Fingerprint(oldCA))
		require.NoError(t, pki.VerifyBundleFingerprint(data, pki.Fingerprint(oldCA)))
		require.NoError(t, pki.VerifyBundleFingerprint(data, pki.Fingerprint(newRoot)))
	})
	t.Run("Without --out the bundle goes to stdout.", func(t *testing.T) {
		t.Parallel()
		stdout, _, err := runPKIStreams(t, "bundle", "--ca-dir", oldDir)
		require.NoError(t, err)
		certs, err := pki.ParseCertificatesPEM([]byte(stdout))
		require.NoError(t, err)
		require.Len(t, certs, 1)
		require.Equal(t, oldCA.Raw, certs[0].Raw)
	})
	t.Run("A directory without bundle.crt uses ca.crt.", func(t *testing.T) {
		t.Parallel()
		legacy := t.TempDir()
		data, err := os.ReadFile(filepath.Join(oldDir, "ca.crt"))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(legacy, "ca.crt"), data, 0o644))
		stdout, _, err := runPKIStreams(t, "bundle", "--ca-dir", legacy)
		require.NoError(t, err)
		require.Equal(t, string(data), stdout)
	})
	t.Run("Adding a certificate that is not a CA is refused.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		_, err := runPKI(t, "init", "--dir", dir)
		require.NoError(t, err)
		_, err = runPKI(t, "issue", "server", "--ca-dir", dir, "--dns", "broker")
		require.NoError(t, err)
		_, err = runPKI(t, "bundle", "--ca-dir", dir, "--add", filepath.Join(dir, "server.crt"))
		require.ErrorContains(t, err, "is not a CA certificate")
	})
}
