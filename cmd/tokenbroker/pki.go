package main

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
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
	caCertName        = pki.CADirCert
	caKeyName         = pki.CADirKey
	rootCertName      = pki.CADirRootCert
	rootKeyName       = pki.CADirRootKey
	bundleName        = pki.CADirBundle
	maxLifetimeDays   = 100 * 365
)

// pkiEnv is what the pki commands take from the outside world, injected so
// that tests can fix the clock.
type pkiEnv struct {
	now  func() time.Time
	rand io.Reader
}

// newPKICommand returns `tokenbroker pki`: the offline side of the PKI. Make
// a CA, issue certificates and join tokens from it by hand, inspect files and
// build trust bundles for a CA rotation.
//
// Output conventions: anything a script captures (a join token, a bundle
// without --out, inspect's description) goes to stdout; progress and
// descriptions of what was written go to stderr; no key is ever printed.
func newPKICommand() *cobra.Command {
	return newPKICommandWith(pkiEnv{now: time.Now, rand: rand.Reader})
}

func newPKICommandWith(env pkiEnv) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pki",
		Short: "Create a CA, issue certificates and join tokens, inspect and bundle certificates",
		Long: `Create the certificate authority that brokers and agents trust, issue
certificates and single-use join tokens from it by hand, describe certificate
and CSR files, and build the trust bundle for a CA rotation. Private keys are
written with mode 0600 and are never printed; certificates are identified by
their SHA-256 fingerprint.

Lifetimes accept Go durations ("720h", "90m") and days ("90d").`,
		Args: cobra.NoArgs,
	}
	cmd.AddCommand(
		newPKIInitCommand(env),
		newPKIIssueCommand(env),
		newPKIInspectCommand(env),
		newPKIJoinTokenCommand(env),
		newPKIBundleCommand(),
	)
	cmd.AddCommand(newPKIRevokeCommand())
	return cmd
}

func newPKIInitCommand(env pkiEnv) *cobra.Command {
	var (
		dir          string
		commonName   string
		force        bool
		intermediate bool
		clusterCAs   bool
		lifetime     = durationFlag(cliCALifetime)
	)
	cmd := &cobra.Command{
		Use:   "init --dir DIR [--intermediate] [--cluster-cas]",
		Short: "Create a new CA in DIR: ca.crt, ca.key and the trust bundle bundle.crt",
		Long: `Create a new ECDSA P-256 certificate authority in DIR, creating DIR with mode
0700 if it is missing. Keys are written with mode 0600, certificates with
0644. Existing files are not overwritten unless --force is given.

Without --intermediate: a self-signed CA that signs leaf certificates only.
  DIR/ca.crt, DIR/ca.key   the CA
  DIR/bundle.crt           the trust bundle (= ca.crt)

With --intermediate: a root that may sign one intermediate (path length 1)
and an intermediate signed by it that signs leaf certificates only (path
length 0). Brokers and "pki issue" use the intermediate; certificates they
issue carry it, so peers trust the root alone.
  DIR/root.crt, DIR/root.key   the root ("<common name> root"); move
                               root.key offline, it is only needed to make
                               a new intermediate
  DIR/ca.crt, DIR/ca.key       the intermediate ("<common name> intermediate"),
                               which expires with the root
  DIR/bundle.crt               the trust bundle (= root.crt)

With --cluster-cas every path length is one more, so that the signing CA may
sign the CAs of clusters (serve --sign-cluster-cas): the intermediates of
their pod certificates, which sign leaf certificates only. Without it the
signing CA signs leaf certificates only and a broker refuses to start with
--sign-cluster-cas.

Default lifetime: 5 years (1825d).`,
		Example: `  tokenbroker pki init --dir ca

  # a root kept offline and an intermediate that signs
  tokenbroker pki init --dir ca --intermediate --common-name "oc.example CA"

  # a signing CA that may also sign the CAs of clusters
  tokenbroker pki init --dir ca --intermediate --cluster-cas`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ca, root, err := pki.InitCADir(dir, pki.CADirOptions{CommonName: commonName, Lifetime: time.Duration(lifetime),
				Intermediate: intermediate, ClusterCAs: clusterCAs, Force: force, Now: env.now, Rand: env.rand})
			if err != nil {
				return withForceHint(err)
			}
			path := func(name string) string { return filepath.Join(dir, name) }
			out := cmd.ErrOrStderr()
			if intermediate {
				fmt.Fprintf(out, "root certificate:         %s\n", path(rootCertName))
				fmt.Fprintf(out, "root key:                 %s (mode 0600; move it offline)\n", path(rootKeyName))
			}
			label := "CA"
			if intermediate {
				label = "intermediate"
			}
			fmt.Fprintf(out, "%-26s%s\n", label+" certificate:", path(caCertName))
			fmt.Fprintf(out, "%-26s%s (mode 0600, keep it secret)\n", label+" key:", path(caKeyName))
			fmt.Fprintf(out, "%-26s%s (what brokers and agents trust)\n", "trust bundle:", path(bundleName))
			if intermediate {
				fmt.Fprintln(out, "root:")
				printCert(out, root.Certificate().Subject.CommonName, root.Certificate().NotAfter, pki.Fingerprint(root.Certificate()))
				fmt.Fprintln(out, "intermediate:")
			}
			printCert(out, ca.Certificate().Subject.CommonName, ca.Certificate().NotAfter, pki.Fingerprint(ca.Certificate()))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&dir, "dir", "", "directory for the CA files (required)")
	f.StringVar(&commonName, "common-name", pki.DefaultCACommonName, "subject common name of the CA (with --intermediate, the root and intermediate get \" root\" and \" intermediate\" appended)")
	f.Var(&lifetime, "lifetime", "validity of the CA, e.g. 1825d or 43800h")
	f.BoolVar(&force, "force", false, "overwrite existing CA files")
	f.BoolVar(&intermediate, "intermediate", false, "make a root and an intermediate CA; the intermediate signs")
	f.BoolVar(&clusterCAs, "cluster-cas", false, "let the signing CA also sign the CAs of clusters (serve --sign-cluster-cas): path length 1 for it, 2 for the root with --intermediate")
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
	out := cmd.ErrOrStderr()
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
		Example: `  tokenbroker pki issue server --ca-dir ca --dns broker.example.com,tokenbroker.tokenbroker.svc
  tokenbroker pki issue server --ca-dir ca --ip 127.0.0.1 --dns localhost`,
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
			printCert(cmd.ErrOrStderr(), strings.Join(names, ", "), kp.Cert.NotAfter, pki.Fingerprint(kp.Cert))
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
		Example: `  tokenbroker pki issue client --ca-dir ca --trust-domain oc.example --cluster west
  tokenbroker pki issue client --ca-dir ca --trust-domain oc.example --cluster west \
    --out-cert west/tls.crt --out-key west/tls.key`,
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
			printCert(cmd.ErrOrStderr(), id, kp.Cert.NotAfter, pki.Fingerprint(kp.Cert))
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

// loadCAWith loads the signing CA of a directory made by "pki init".
func loadCAWith(dir string, env pkiEnv) (*pki.CA, error) {
	return pki.LoadCADir(dir, pki.CAOptions{Now: env.now, Rand: env.rand})
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

// --- pki inspect ---

func newPKIInspectCommand(env pkiEnv) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "inspect FILE",
		Short: "Describe a certificate, a certificate chain or a CSR",
		Long: `Describe the PEM certificates (a leaf, a chain or a bundle) or the PEM
certificate signing request in FILE: subject, issuer, SANs, cluster identity,
serial number, validity, key type, key usages, CA constraints and SHA-256
fingerprint. For a CSR it also says whether a broker would accept it for
enrollment. "-" reads standard input. Nothing secret is printed; a key file is
refused.

-o json prints a JSON list with one object per certificate.`,
		Example: `  tokenbroker pki inspect ca/west.crt
  tokenbroker pki inspect -o json ca/bundle.crt | jq -r '.[].fingerprint'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if output != "text" && output != "json" {
				return fmt.Errorf("-o must be text or json, not %q", output)
			}
			data, err := readInput(args[0], cmd.InOrStdin())
			if err != nil {
				return err
			}
			descs, err := pki.Describe(data, env.now())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if output == "json" {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(descs)
			}
			for i, d := range descs {
				if i > 0 {
					fmt.Fprintln(out)
				}
				writeDescription(out, d, i, len(descs), env.now())
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "text", "output format: text or json")
	return cmd
}

// readInput reads a certificate file, or stdin for "-", bounded like every
// PEM input.
func readInput(name string, stdin io.Reader) ([]byte, error) {
	if name != "-" {
		return pki.ReadFileLimit(name, pki.MaxCertificatesPEMSize)
	}
	data, err := io.ReadAll(io.LimitReader(stdin, pki.MaxCertificatesPEMSize+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	if len(data) > pki.MaxCertificatesPEMSize {
		return nil, fmt.Errorf("read %s: %w", name, pki.ErrPEMTooLarge)
	}
	return data, nil
}

func writeDescription(out io.Writer, d pki.Description, i, n int, now time.Time) {
	title := "Certificate"
	if d.Type == "certificateRequest" {
		title = "Certificate request"
	}
	if n > 1 {
		title = fmt.Sprintf("%s %d of %d", title, i+1, n)
	}
	fmt.Fprintln(out, title)
	line := func(k, v string) {
		if v != "" {
			fmt.Fprintf(out, "  %-15s %s\n", k+":", v)
		}
	}
	line("subject", d.Subject)
	line("issuer", d.Issuer)
	if d.Identity != "" {
		line("identity", d.Identity)
	} else if d.IdentityError != "" {
		line("identity", "none ("+d.IdentityError+")")
	}
	var sans []string
	for _, s := range d.DNSNames {
		sans = append(sans, "DNS:"+s)
	}
	for _, s := range d.IPAddresses {
		sans = append(sans, "IP:"+s)
	}
	for _, s := range d.URIs {
		sans = append(sans, "URI:"+s)
	}
	for _, s := range d.EmailAddresses {
		sans = append(sans, "email:"+s)
	}
	line("SANs", strings.Join(sans, ", "))
	line("serial", d.SerialNumber)
	if d.NotAfter != nil {
		line("valid", fmt.Sprintf("%s to %s (%s)", d.NotBefore.Format(time.RFC3339), d.NotAfter.Format(time.RFC3339), expiresIn(now, *d.NotAfter)))
	}
	line("key", d.KeyType)
	line("key usage", strings.Join(d.KeyUsage, ", "))
	line("ext key usage", strings.Join(d.ExtKeyUsage, ", "))
	if d.Type == "certificate" {
		ca := "no"
		if d.IsCA {
			ca = "yes, path length unlimited"
			if d.MaxPathLen != nil {
				ca = fmt.Sprintf("yes, path length %d", *d.MaxPathLen)
			}
			if d.SelfSigned {
				ca += ", self-signed root"
			}
		}
		line("CA", ca)
	}
	line("fingerprint", d.Fingerprint)
	if d.Type == "certificateRequest" {
		verdict := "accepted for " + d.Identity
		if d.EnrollmentError != "" {
			verdict = "refused: " + d.EnrollmentError
		}
		line("enrollment", verdict)
	}
}

// expiresIn says how long until notAfter in words a person reads at a
// glance: "expires in 29d 23h", "expired 2h 5m ago".
func expiresIn(now, notAfter time.Time) string {
	d := notAfter.Sub(now)
	if d < 0 {
		return "expired " + roughDuration(-d) + " ago"
	}
	return "expires in " + roughDuration(d)
}

func roughDuration(d time.Duration) string {
	days := d / (24 * time.Hour)
	hours := (d % (24 * time.Hour)) / time.Hour
	minutes := (d % time.Hour) / time.Minute
	switch {
	case days > 0:
		return fmt.Sprintf("%dd %dh", days, hours)
	case hours > 0:
		return fmt.Sprintf("%dh %dm", hours, minutes)
	default:
		return fmt.Sprintf("%dm %ds", minutes, (d%time.Minute)/time.Second)
	}
}

// --- pki join-token ---

func newPKIJoinTokenCommand(env pkiEnv) *cobra.Command {
	var (
		caDir, trustDomain, cluster string
		audiences                   []string
		ttl                         time.Duration
	)
	cmd := &cobra.Command{
		Use:   "join-token --ca-dir DIR --trust-domain TD --cluster NAME --audience BROKER... [--ttl 10m]",
		Short: "Make a single-use join token that lets a new cluster enroll as spiffe://TD/cluster/NAME",
		Long: `Make a join token: a JWT signed (ES256) by the CA in DIR that lets one new
cluster enroll, once, as spiffe://TD/cluster/NAME and get its first client
certificate from a broker of this CA ("tokenbroker enroll").

--audience names the broker the token is for (repeat it for several): the
name the broker answers to, which is its policy's cluster.name unless serve
--broker-name says otherwise. Any other broker of the same CA refuses the
token, so that it cannot be replayed there. (Brokers refuse tokens made
without an audience, as older releases made them, unless serve
--accept-unbound-join-tokens is set.)

The token, and nothing else, is printed on standard output, so that
TOKEN=$(tokenbroker pki join-token ...) works. It is a secret until it is used
or expires: hand it over out of band. Standard error shows the identity, the
token ID (jti, what the broker logs), the expiry and the fingerprint of the
root CA that the joining cluster must pin with --ca-fingerprint.

Default TTL: 10 minutes; at most 24h.`,
		Example: `  tokenbroker pki join-token --ca-dir ca --trust-domain oc.example --cluster west --audience east > west.token`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			id, err := pki.ClusterIdentity(trustDomain, cluster)
			if err != nil {
				return err
			}
			ca, err := loadCAWith(caDir, env)
			if err != nil {
				return err
			}
			token, claims, err := ca.IssueJoinToken(pki.JoinTokenOptions{Identity: id, Audiences: audiences, TTL: ttl, Now: env.now, Rand: env.rand})
			if err != nil {
				return err
			}
			anchors, err := pki.ParseCertificatesPEM(ca.BundlePEM())
			if err != nil {
				return err
			}
			if _, err := fmt.Fprintln(cmd.OutOrStdout(), token); err != nil {
				return err
			}
			out := cmd.ErrOrStderr()
			fmt.Fprintf(out, "identity:       %s\n", claims.Identity)
			fmt.Fprintf(out, "token id (jti): %s\n", claims.ID)
			fmt.Fprintf(out, "for brokers:    %s\n", strings.Join(claims.Audiences, ", "))
			fmt.Fprintf(out, "expires:        %s (valid for %s)\n", claims.ExpiresAt.Format(time.RFC3339), claims.ExpiresAt.Sub(claims.IssuedAt))
			for _, a := range anchors {
				fmt.Fprintf(out, "CA to pin:      %s (%s)\n", pki.Fingerprint(a), a.Subject.CommonName)
			}
			fmt.Fprintf(out, "on the new cluster: tokenbroker enroll --broker URL --ca-fingerprint %s --token-file FILE --dir DIR\n", pki.Fingerprint(anchors[0]))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&caDir, "ca-dir", "", "directory made by `pki init` (required)")
	f.StringVar(&trustDomain, "trust-domain", "", "trust domain, e.g. oc.example (required)")
	f.StringVar(&cluster, "cluster", "", "name of the joining cluster, a DNS-1123 label (required)")
	f.StringSliceVar(&audiences, "audience", nil, "name of the broker the token is for (its policy's cluster.name, or serve --broker-name), repeatable; other brokers of the CA refuse the token (required)")
	f.DurationVar(&ttl, "ttl", pki.DefaultJoinTokenTTL, "validity of the token, at most 24h")
	for _, name := range []string{"ca-dir", "trust-domain", "cluster", "audience"} {
		_ = cmd.MarkFlagRequired(name)
	}
	return cmd
}

// --- pki bundle ---

func newPKIBundleCommand() *cobra.Command {
	var (
		caDir  string
		add    []string
		output string
	)
	cmd := &cobra.Command{
		Use:   "bundle --ca-dir DIR [--add OLD.crt ...] [--out FILE]",
		Short: "Build the trust bundle: the CA of DIR plus other CAs during a rotation",
		Long: `Build the PEM trust bundle that brokers (--client-ca) and agents trust: the
trust anchors of DIR (DIR/bundle.crt, or DIR/ca.crt for a directory without
one) followed by the CA certificates of every --add file, without duplicates.
Every certificate must be a CA.

A CA rotation: make the new CA with "pki init", publish a bundle of the new
CA with --add of the old one, move brokers and agents to certificates of the
new CA, then publish the bundle of the new CA alone. Brokers reload the
bundle file without a restart.

The bundle goes to --out (written atomically, mode 0644, replacing the file)
or, without --out, to standard output. The fingerprints go to standard
error.`,
		Example: `  tokenbroker pki bundle --ca-dir new-ca --add old-ca/bundle.crt --out client-ca.crt`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			sources := []pki.PEMSource{}
			for _, file := range append([]string{pki.CADirTrustAnchors(caDir)}, add...) {
				data, err := readInput(file, cmd.InOrStdin())
				if err != nil {
					return err
				}
				sources = append(sources, pki.PEMSource{Name: file, PEM: data})
			}
			certs, bundle, err := pki.BuildTrustBundle(sources)
			if err != nil {
				return err
			}
			if output == "" {
				if _, err := cmd.OutOrStdout().Write(bundle); err != nil {
					return err
				}
			} else if err := pki.WriteCertificatesFile(output, bundle, true); err != nil {
				return err
			}
			out := cmd.ErrOrStderr()
			if output != "" {
				fmt.Fprintf(out, "trust bundle: %s\n", output)
			}
			for _, c := range certs {
				fmt.Fprintf(out, "%s  %s (expires %s)\n", pki.Fingerprint(c), c.Subject.CommonName, c.NotAfter.UTC().Format(time.RFC3339))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&caDir, "ca-dir", "", "directory made by `pki init` (required)")
	f.StringArrayVar(&add, "add", nil, "file of CA certificates to add, e.g. the previous CA's bundle.crt (repeatable)")
	f.StringVar(&output, "out", "", "file to write the bundle to (default standard output)")
	_ = cmd.MarkFlagRequired("ca-dir")
	return cmd
}
