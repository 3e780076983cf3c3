package main

import (
	"bytes"
	"crypto/rand"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

var pkiTestNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// runPKI runs `pki args...` in-process with a fixed clock and returns stdout.
func runPKI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newPKICommandWith(pkiEnv{now: func() time.Time { return pkiTestNow }, rand: rand.Reader})
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
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
				require.Len(t, entries, 3, "only ca.crt, ca.key and out/")
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
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			out, err := runPKI(t, tt.args...)
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
