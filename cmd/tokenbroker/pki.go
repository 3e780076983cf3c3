package main

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Defaults of the pki commands. The client default is longer than
// pki.DefaultClientLifetime (24h, for enrolled certificates that renew
// themselves) because a hand-issued certificate is renewed by hand.
const (
	cliCALifetime     = pki.DefaultCALifetime
	cliServerLifetime = pki.DefaultServerLifetime
	cliClientLifetime = 30 * 24 * time.Hour
	caCertName        = "ca.crt"
	caKeyName         = "ca.key"
	maxLifetimeDays   = 100 * 365
)

// pkiEnv is what the pki commands take from the outside world, injected so
// that tests can fix the clock.
type pkiEnv struct {
	now  func() time.Time
	rand io.Reader
}

// newPKICommand returns `tokenbroker pki`: make a CA and issue certificates
// from it by hand, for bootstrapping and for tests.
func newPKICommand() *cobra.Command {
	return newPKICommandWith(pkiEnv{now: time.Now, rand: rand.Reader})
}

func newPKICommandWith(env pkiEnv) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pki",
		Short: "Create a CA and issue broker and cluster certificates",
		Long: `Create the certificate authority that brokers and agents trust, and issue
certificates from it by hand. Private keys are written with mode 0600 and are
never printed; certificates are identified by their SHA-256 fingerprint.

Lifetimes accept Go durations ("720h", "90m") and days ("90d").`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(newPKIInitCommand(env), newPKIIssueCommand(env))
	return cmd
}

func newPKIInitCommand(env pkiEnv) *cobra.Command {
	var (
		dir        string
		commonName string
		force      bool
		lifetime   = durationFlag(cliCALifetime)
	)
	cmd := &cobra.Command{
		Use:   "init --dir DIR",
		Short: "Create a new self-signed CA in DIR/ca.crt and DIR/ca.key",
		Long: `Create a new self-signed ECDSA P-256 CA that may sign leaf certificates only.
Writes DIR/ca.crt (mode 0644) and DIR/ca.key (mode 0600), creating DIR with
mode 0700 if it is missing. Existing files are not overwritten unless --force
is given.

Default lifetime: 5 years (1825d).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// 0700: the directory holds the CA key.
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return fmt.Errorf("create CA directory: %w", err)
			}
			certFile, keyFile := filepath.Join(dir, caCertName), filepath.Join(dir, caKeyName)
			ca, err := pki.NewCA(pki.CAOptions{
				CommonName: commonName,
				Lifetime:   time.Duration(lifetime),
				Now:        env.now,
				Rand:       env.rand,
			})
			if err != nil {
				return err
			}
			write := ca.WriteFiles
			if force {
				write = ca.ReplaceFiles
			}
			if err := write(certFile, keyFile); err != nil {
				return withForceHint(err)
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "CA certificate: %s\n", certFile)
			fmt.Fprintf(out, "CA key:         %s (mode 0600, keep it secret)\n", keyFile)
			printCert(out, ca.Certificate().Subject.CommonName, ca.Certificate().NotAfter, pki.Fingerprint(ca.Certificate()))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&dir, "dir", "", "directory for ca.crt and ca.key (required)")
	f.StringVar(&commonName, "common-name", pki.DefaultCACommonName, "subject common name of the CA")
	f.Var(&lifetime, "lifetime", "validity of the CA, e.g. 1825d or 43800h")
	f.BoolVar(&force, "force", false, "overwrite existing CA files")
	_ = cmd.MarkFlagRequired("dir")
	return cmd
}

func newPKIIssueCommand(env pkiEnv) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "issue",
		Short: "Issue a server or cluster client certificate from a CA made by `pki init`",
		Args:  cobra.NoArgs,
	}
	cmd.AddCommand(newPKIIssueServerCommand(env), newPKIIssueClientCommand(env))
	return cmd
}

// issueFlags are the flags both issue commands share.
type issueFlags struct {
	caDir    string
	outCert  string
	outKey   string
	force    bool
	lifetime durationValue
}

func (fl *issueFlags) register(cmd *cobra.Command, defaultName string) {
	f := cmd.Flags()
	f.StringVar(&fl.caDir, "ca-dir", "", "directory holding ca.crt and ca.key (required)")
	f.StringVar(&fl.outCert, "out-cert", "", "certificate file to write (default CA-DIR/"+defaultName+".crt)")
	f.StringVar(&fl.outKey, "out-key", "", "key file to write, mode 0600 (default CA-DIR/"+defaultName+".key)")
	f.BoolVar(&fl.force, "force", false, "overwrite existing output files")
	f.Var(&fl.lifetime, "lifetime", "validity of the certificate, e.g. 90d or 2160h")
	_ = cmd.MarkFlagRequired("ca-dir")
}

// issue loads the CA, calls issue and writes the result.
func (fl *issueFlags) run(cmd *cobra.Command, env pkiEnv, name string, issue func(*pki.CA) (*pki.KeyPair, error)) error {
	ca, err := loadCAWith(fl.caDir, env)
	if err != nil {
		return err
	}
	kp, err := issue(ca)
	if err != nil {
		return err
	}
	certFile, keyFile := fl.outCert, fl.outKey
	if certFile == "" {
		certFile = filepath.Join(fl.caDir, name+".crt")
	}
	if keyFile == "" {
		keyFile = filepath.Join(fl.caDir, name+".key")
	}
	write := kp.CreateFiles
	if fl.force {
		write = kp.WriteFiles
	}
	if err := write(certFile, keyFile); err != nil {
		return withForceHint(err)
	}
	out := cmd.OutOrStdout()
	fmt.Fprintf(out, "certificate: %s\n", certFile)
	fmt.Fprintf(out, "key:         %s (mode 0600, keep it secret)\n", keyFile)
	return nil
}

func newPKIIssueServerCommand(env pkiEnv) *cobra.Command {
	fl := issueFlags{lifetime: durationFlag(cliServerLifetime)}
	var (
		dnsNames []string
		ips      []string
	)
	cmd := &cobra.Command{
		Use:   "server --ca-dir DIR --dns NAME[,NAME] [--ip IP[,IP]]",
		Short: "Issue a broker server certificate",
		Long: `Issue a TLS server certificate (extended key usage serverAuth) with a new
ECDSA P-256 key, for the broker's mTLS listener. At least one --dns or --ip is
required.

Default lifetime: 90 days. Default output: CA-DIR/server.crt and
CA-DIR/server.key (mode 0600); existing files are not overwritten unless
--force is given.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts := pki.ServerOptions{DNSNames: dnsNames, Lifetime: time.Duration(fl.lifetime)}
			for _, s := range ips {
				ip := net.ParseIP(strings.TrimSpace(s))
				if ip == nil {
					return fmt.Errorf("invalid --ip %q", s)
				}
				opts.IPAddresses = append(opts.IPAddresses, ip)
			}
			var kp *pki.KeyPair
			err := fl.run(cmd, env, "server", func(ca *pki.CA) (*pki.KeyPair, error) {
				var err error
				kp, err = ca.IssueServer(opts)
				return kp, err
			})
			if err != nil {
				return err
			}
			names := append([]string(nil), kp.Cert.DNSNames...)
			for _, ip := range kp.Cert.IPAddresses {
				names = append(names, ip.String())
			}
			printCert(cmd.OutOrStdout(), strings.Join(names, ", "), kp.Cert.NotAfter, pki.Fingerprint(kp.Cert))
			return nil
		},
	}
	fl.register(cmd, "server")
	cmd.Flags().StringSliceVar(&dnsNames, "dns", nil, "DNS names (SANs), comma-separated")
	cmd.Flags().StringSliceVar(&ips, "ip", nil, "IP addresses (SANs), comma-separated")
	return cmd
}

func newPKIIssueClientCommand(env pkiEnv) *cobra.Command {
	fl := issueFlags{lifetime: durationFlag(cliClientLifetime)}
	var trustDomain, cluster string
	cmd := &cobra.Command{
		Use:   "client --ca-dir DIR --trust-domain TD --cluster NAME",
		Short: "Issue a cluster client certificate (identity spiffe://TD/cluster/NAME)",
		Long: `Issue a TLS client certificate (extended key usage clientAuth) with a new
ECDSA P-256 key for the cluster identity spiffe://TD/cluster/NAME, carried as
the only URI SAN and as the common name. TD is a lowercase DNS-style name,
NAME a DNS-1123 label.

Default lifetime: 30 days (enrolled agents get 24h certificates and renew
them; a hand-issued one is renewed by hand). Default output: CA-DIR/NAME.crt
and CA-DIR/NAME.key (mode 0600); existing files are not overwritten unless
--force is given.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			id, err := pki.ClusterIdentity(trustDomain, cluster)
			if err != nil {
				return err
			}
			var kp *pki.KeyPair
			err = fl.run(cmd, env, cluster, func(ca *pki.CA) (*pki.KeyPair, error) {
				var err error
				kp, err = ca.IssueClient(pki.ClientOptions{Identity: id, Lifetime: time.Duration(fl.lifetime)})
				return kp, err
			})
			if err != nil {
				return err
			}
			printCert(cmd.OutOrStdout(), id, kp.Cert.NotAfter, pki.Fingerprint(kp.Cert))
			return nil
		},
	}
	fl.register(cmd, "<cluster>")
	cmd.Flags().StringVar(&trustDomain, "trust-domain", "", "trust domain, e.g. oc.example (required)")
	cmd.Flags().StringVar(&cluster, "cluster", "", "cluster name, a DNS-1123 label (required)")
	_ = cmd.MarkFlagRequired("trust-domain")
	_ = cmd.MarkFlagRequired("cluster")
	return cmd
}

func loadCAWith(dir string, env pkiEnv) (*pki.CA, error) {
	return pki.LoadCAWithOptions(filepath.Join(dir, caCertName), filepath.Join(dir, caKeyName),
		pki.CAOptions{Now: env.now, Rand: env.rand})
}

func printCert(out io.Writer, subject string, notAfter time.Time, fingerprint string) {
	fmt.Fprintf(out, "subject:     %s\n", subject)
	fmt.Fprintf(out, "expires:     %s\n", notAfter.UTC().Format(time.RFC3339))
	fmt.Fprintf(out, "fingerprint: %s\n", fingerprint)
}

func withForceHint(err error) error {
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w; use --force to overwrite", err)
	}
	return err
}

// durationValue is a flag value that accepts Go durations and whole days
// ("90d"), which is how certificate lifetimes are usually spoken of.
type durationValue time.Duration

func durationFlag(d time.Duration) durationValue { return durationValue(d) }

// String implements pflag.Value.
func (d *durationValue) String() string {
	td := time.Duration(*d)
	if td > 0 && td%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(td/(24*time.Hour)), 10) + "d"
	}
	return td.String()
}

// Set implements pflag.Value.
func (d *durationValue) Set(s string) error {
	var td time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.ParseInt(days, 10, 32)
		if err != nil || n > maxLifetimeDays {
			return fmt.Errorf("invalid days %q (at most %d)", s, maxLifetimeDays)
		}
		td = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		td, err = time.ParseDuration(s)
		if err != nil {
			return err
		}
	}
	if td <= 0 {
		return fmt.Errorf("lifetime must be positive, got %q", s)
	}
	*d = durationValue(td)
	return nil
}

// Type implements pflag.Value.
func (d *durationValue) Type() string { return "duration" }
