package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/client-go/kubernetes"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// leasesOptions is the typed configuration of "tokenbroker leases" and
// "tokenbroker leases revoke".
type leasesOptions struct {
	Kubeconfig string
	Context    string
	// Namespace is empty for every namespace.
	Namespace      string
	AllNamespaces  bool
	ServiceAccount string
	Peer           string
	Output         string
}

// Output formats of "tokenbroker leases".
var leasesOutputs = []string{"table", "wide", "json"}

func newLeasesCommand() *cobra.Command {
	var o leasesOptions
	cmd := &cobra.Command{
		Use:   "leases [-n NAMESPACE | -A] [--service-account SA] [--peer NAME] [-o table|wide|json]",
		Short: "List who holds a credential: the lease Secrets of this cluster (admin)",
		Long: `List the leases of the cluster the broker runs in, with the administrator's
Kubernetes credentials: every credential the broker issued that has not been
collected yet, with the peer that holds it and since when.

A lease is a Secret labelled ` + objects.LabelKind + `=` + objects.LeaseKind + ` in the namespace of the
ServiceAccount; the token issued with it is bound to it, so it lives no longer
than the Secret (see "tokenbroker leases revoke"). ISSUED is the Secret's
creation time, EXPIRES the credential's expiry; a lease that has expired but
that the broker's garbage collector has not deleted yet shows "expired".

Every namespace is searched unless -n is given (not the kubeconfig context's
namespace). --peer selects by label on the API server; --service-account is
matched here, since the ServiceAccount is an annotation. The list is read
and printed a page of 500 leases at a time, as the API server pages it:
namespace by namespace, each page sorted by namespace, ServiceAccount and
issue time (one sorted list when there are no more than 500).

Uses --kubeconfig, else $KUBECONFIG, else ~/.kube/config; it needs the RBAC
permission to list Secrets in the namespaces searched (cluster-wide without
-n). Nothing but the Secrets' metadata is printed.`,
		Example: `  # which peer holds a credential for argo/admiralty-source right now, and since when
  tokenbroker leases -n argo --service-account admiralty-source

  # every lease of the cluster, with absolute times and the credential kind
  tokenbroker leases -o wide

  # the leases of the peer "west", as JSON
  tokenbroker leases --peer west -o json | jq -r '.[] | "\(.namespace)/\(.serviceAccount) \(.expiresAt)"'`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.validate(); err != nil {
				return err
			}
			secrets, err := adminSecrets(o.Kubeconfig, o.Context)
			if err != nil {
				return err
			}
			return runLeases(cmd.Context(), secrets, o, cmd.OutOrStdout(), cmd.ErrOrStderr(), time.Now())
		},
	}
	addAdminKubeFlags(cmd, &o)
	fs := cmd.Flags()
	fs.BoolVarP(&o.AllNamespaces, "all-namespaces", "A", false, "every namespace (the default without -n)")
	fs.StringVar(&o.ServiceAccount, "service-account", "", "only the leases of this ServiceAccount (NAME, or NAMESPACE/NAME)")
	fs.StringVar(&o.Peer, "peer", "", "only the leases of this peer (its name in the policy)")
	fs.StringVarP(&o.Output, "output", "o", "table", "output format: table, wide or json")
	_ = cmd.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(leasesOutputs, cobra.ShellCompDirectiveNoFileComp))
	cmd.AddCommand(newLeasesRevokeCommand(&o))
	return cmd
}

// addAdminKubeFlags adds the flags that say how to reach the cluster, on
// "leases" and inherited by its subcommands.
func addAdminKubeFlags(cmd *cobra.Command, o *leasesOptions) {
	fs := cmd.PersistentFlags()
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "the administrator's kubeconfig of the broker's cluster (default $KUBECONFIG, else ~/.kube/config)")
	fs.StringVar(&o.Context, "context", "", "kubeconfig context to use (default: its current context)")
	fs.StringVarP(&o.Namespace, "namespace", "n", "", "only this namespace (default: every namespace)")
}

func (o *leasesOptions) validate() error {
	if o.AllNamespaces && o.Namespace != "" {
		return errors.New("give -n NAMESPACE or -A, not both")
	}
	if ns, sa, ok := strings.Cut(o.ServiceAccount, "/"); ok {
		switch {
		case o.AllNamespaces:
			return fmt.Errorf("--service-account %s names a namespace; -A does not go with it", o.ServiceAccount)
		case o.Namespace != "" && o.Namespace != ns:
			return fmt.Errorf("--service-account %s is in namespace %s, not -n %s", o.ServiceAccount, ns, o.Namespace)
		}
		o.Namespace, o.ServiceAccount = ns, sa
	}
	if !slices.Contains(leasesOutputs, o.Output) {
		return fmt.Errorf("--output must be one of %s, not %q", strings.Join(leasesOutputs, ", "), o.Output)
	}
	return nil
}

// leasesKubeQPS and leasesKubeBurst replace client-go's default
// client-side limit (5 requests/s, burst 10) for the lease commands. They
// make one request at a time, so the limit only stretched a long walk: the
// 101 pages of 50,000 leases took 18 s, nearly all of it waiting on the
// limiter. The API server's priority and fairness remains the guard.
const (
	leasesKubeQPS   = 100
	leasesKubeBurst = 200
)

// adminSecrets returns a Secrets client with the administrator's
// credentials, loaded like kubectl loads them, and the lease commands'
// client-side limit.
func adminSecrets(kubeconfig, context string) (corev1client.SecretsGetter, error) {
	client, err := leasesClient(kubeconfig, context)
	if err != nil {
		return nil, err
	}
	return client.CoreV1(), nil
}

// leasesClient is the lease commands' Kubernetes client: the caller's
// credentials, with the lease commands' client-side limit (client-go's
// default of 5 requests a second would make a bulk revocation in an
// incident crawl).
func leasesClient(kubeconfig, context string) (kubernetes.Interface, error) {
	return adminClient(kubeconfig, context, func(rc *rest.Config) { rc.QPS, rc.Burst = leasesKubeQPS, leasesKubeBurst })
}

// adminClient is a Kubernetes client with the caller's credentials: the
// kubeconfig file if given, else $KUBECONFIG or ~/.kube/config, in the
// given context or the current one; tune, if set, adjusts its rest.Config.
func adminClient(kubeconfig, context string, tune func(*rest.Config)) (kubernetes.Interface, error) {
	rc, err := restConfig(kubeconfig, context)
	if err != nil {
		return nil, err
	}
	if tune != nil {
		tune(rc)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("create Kubernetes client: %w", err)
	}
	return client, nil
}

// explainAPIError turns the API server's refusal of verb on Secrets into
// an error that says which permission is missing.
func explainAPIError(err error, verb, namespace string) error {
	scope, canI := "in every namespace", "--all-namespaces"
	if namespace != "" {
		scope, canI = "in namespace "+namespace, "-n "+namespace
	}
	switch {
	case apierrors.IsForbidden(err):
		return fmt.Errorf("%s lease Secrets %s: permission missing: %s secrets %s (check with: kubectl auth can-i %s secrets %s): %w",
			verb, scope, verb, scope, verb, canI, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("%s lease Secrets: the API server did not accept the kubeconfig's credentials: %w", verb, err)
	default:
		return fmt.Errorf("%s lease Secrets %s: %w", verb, scope, err)
	}
}

// runLeases lists the lease Secrets page by page (the API server's
// paging) and prints each page as it comes, so that the first lines of a
// large cluster show at once and memory holds one page.
func runLeases(ctx context.Context, secrets corev1client.SecretsGetter, o leasesOptions, out, errOut io.Writer, now time.Time) error {
	var sel labels.Set
	if o.Peer != "" {
		sel = labels.Set{objects.LabelPeer: o.Peer}
	}
	p := newLeasePrinter(out, o.Output, now)
	err := lease.EachSecretPage(ctx, secrets, o.Namespace, sel, func(page []corev1.Secret) error {
		return p.page(lease.Records(page, o.ServiceAccount, now))
	})
	if err != nil {
		return explainAPIError(err, "list", o.Namespace)
	}
	return p.end(errOut)
}

// leasePrinter prints lease records in one of leasesOutputs, a page at a
// time: a table gets its header once and is aligned within each page (as
// kubectl's chunked lists are); JSON is one array, written element by
// element.
type leasePrinter struct {
	out    io.Writer
	format string
	now    time.Time
	n      int
}

func newLeasePrinter(out io.Writer, format string, now time.Time) *leasePrinter {
	return &leasePrinter{out: out, format: format, now: now}
}

// page prints one page of records.
func (p *leasePrinter) page(records []lease.Record) error {
	if p.format == "json" {
		return p.jsonPage(records)
	}
	if len(records) == 0 {
		return nil
	}
	wide := p.format == "wide"
	tw := tabwriter.NewWriter(p.out, 0, 8, 3, ' ', 0)
	if p.n == 0 {
		header := "NAMESPACE\tSERVICEACCOUNT\tPEER\tIDENTITY\tLEASE\tISSUED\tEXPIRES"
		if wide {
			header += "\tCREDENTIAL\tGRANT\tISSUED-AT\tEXPIRES-AT\tWORKLOAD"
		}
		fmt.Fprintln(tw, header)
	}
	now := p.now
	for _, r := range records {
		line := strings.Join([]string{r.Namespace, r.ServiceAccount, orNone(r.Peer), orNone(r.Identity), r.ID,
			ago(now, r.CreatedAt), leaseExpiry(now, r.ExpiresAt)}, "\t")
		if wide {
			exp := "<unknown>"
			if r.ExpiresAt != nil {
				exp = r.ExpiresAt.Format(time.RFC3339)
			}
			// WORKLOAD: the source cluster's namespace/serviceAccount
			// that asked with a workload token, <none> without one.
			line += "\t" + strings.Join([]string{orNone(r.Credential), orNone(r.Grant), r.CreatedAt.Format(time.RFC3339), exp, orNone(r.Workload)}, "\t")
		}
		fmt.Fprintln(tw, line)
	}
	p.n += len(records)
	return tw.Flush()
}

// jsonPage writes records as the next elements of one JSON array indented
// as json.Encoder with SetIndent("", "  ") indents a whole slice.
func (p *leasePrinter) jsonPage(records []lease.Record) error {
	for _, r := range records {
		b, err := json.MarshalIndent(r, "  ", "  ")
		if err != nil {
			return err
		}
		sep := ",\n  "
		if p.n == 0 {
			sep = "[\n  "
		}
		if _, err := io.WriteString(p.out, sep); err != nil {
			return err
		}
		if _, err := p.out.Write(b); err != nil {
			return err
		}
		p.n++
	}
	return nil
}

// end finishes the output. An empty table is a message on errOut, as
// kubectl does, so that stdout stays parseable.
func (p *leasePrinter) end(errOut io.Writer) error {
	switch {
	case p.format == "json" && p.n == 0:
		_, err := io.WriteString(p.out, "[]\n")
		return err
	case p.format == "json":
		_, err := io.WriteString(p.out, "\n]\n")
		return err
	case p.n == 0:
		_, err := fmt.Fprintln(errOut, "No leases.")
		return err
	}
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "<none>"
	}
	return s
}

// ago is a past time as kubectl shows ages: "12m ago".
func ago(now, t time.Time) string {
	d := now.Sub(t)
	if d < 0 {
		d = 0 // clock skew between this machine and the API server
	}
	return duration.HumanDuration(d) + " ago"
}

// leaseExpiry is an expiry as "in 48m", "expired" or "<unknown>".
func leaseExpiry(now time.Time, exp *time.Time) string {
	switch {
	case exp == nil:
		return "<unknown>"
	case !now.Before(*exp):
		return "expired"
	default:
		return "in " + duration.HumanDuration(exp.Sub(now))
	}
}

func newLeasesRevokeCommand(o *leasesOptions) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "revoke [-n NAMESPACE] LEASE_ID...",
		Short: "Revoke leases: delete their Secrets, which kills the credentials bound to them (admin)",
		Long: `Revoke leases with the administrator's Kubernetes credentials, for incident
response, as the broker revokes them: a client certificate's RoleBinding (its
only permission) first, then each lease's Secret. The token issued with a lease is bound
to its Secret, so the API server rejects it once the Secret is gone (within
about 10 seconds: it caches a token's authentication that long); the peer's
"GET /v1/leases" no longer shows it.

The lease ids are those "tokenbroker leases" prints (LEASE). Without -n every
namespace is searched. Needs the RBAC permissions to list and delete Secrets
there, and to get and delete RoleBindings for certificate leases. Each revoked lease is printed; an id that is not found is an error
(exit status 1) after the others are revoked.

A peer revokes its own leases through the broker (DELETE /v1/leases/ID); to
stop a peer from getting new credentials, revoke its identity too
("tokenbroker pki revoke") or remove it from the policy.`,
		Example: `  tokenbroker leases -n argo --service-account admiralty-source
  tokenbroker leases revoke -n argo q3fcxb7kumyz4pa2m6dxx5jnle

  # every lease of the peer "west"
  tokenbroker leases --peer west -o json | jq -r '.[].id' | xargs tokenbroker leases revoke`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, ids []string) error {
			client, err := leasesClient(o.Kubeconfig, o.Context)
			if err != nil {
				return err
			}
			d := &lease.Deleter{Secrets: client.CoreV1(), RoleBindings: client.RbacV1()}
			return runLeasesRevoke(cmd.Context(), d, o.Namespace, ids, cmd.OutOrStdout(), time.Now())
		},
		ValidArgsFunction: func(cmd *cobra.Command, args []string, _ string) ([]string, cobra.ShellCompDirective) {
			return completeLeaseIDs(cmd.Context(), o, args)
		},
	}
	return cmd
}

// completeLeaseIDs offers the ids of the leases the completing user can
// list, described by what they are for.
func completeLeaseIDs(ctx context.Context, o *leasesOptions, done []string) ([]string, cobra.ShellCompDirective) {
	secrets, err := adminSecrets(o.Kubeconfig, o.Context)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	list, err := lease.ListSecrets(ctx, secrets, o.Namespace, nil)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []string
	for _, r := range lease.Records(list, "", time.Now()) {
		if !slices.Contains(done, r.ID) {
			out = append(out, fmt.Sprintf("%s\t%s/%s, peer %s", r.ID, r.Namespace, r.ServiceAccount, r.Peer))
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// runLeasesRevoke revokes the leases with the given ids in namespace (""
// for every namespace) as the broker does (lease.Deleter: a client
// certificate's RoleBinding, then the Secret with its UID as precondition)
// and reports each to out.
func runLeasesRevoke(ctx context.Context, d *lease.Deleter, namespace string, ids []string, out io.Writer, now time.Time) error {
	var errs []error
	for _, id := range ids {
		if !apiv1.ValidLeaseID(id) {
			errs = append(errs, fmt.Errorf("%q is not a lease id (26 characters a-z, 2-7, as \"tokenbroker leases\" shows them)", id))
			continue
		}
		list, err := secretsNamed(ctx, d.Secrets, namespace, objects.LeaseSecretPrefix+id)
		if err != nil {
			return errors.Join(append(errs, explainAPIError(err, "list", namespace))...)
		}
		if len(list) == 0 {
			where := "in any namespace"
			if namespace != "" {
				where = "in namespace " + namespace
			}
			errs = append(errs, fmt.Errorf("lease %s not found %s (expired and collected, or already revoked?)", id, where))
			continue
		}
		byName := make(map[string]*corev1.Secret, len(list))
		for i := range list {
			byName[list[i].Namespace+"/"+list[i].Name] = &list[i]
		}
		for _, r := range lease.Records(list, "", now) {
			s := byName[r.Namespace+"/"+r.Secret]
			if s == nil || s.Type != objects.SecretTypeLease || s.UID == "" {
				// Someone's Secret with a lease's labels: not the broker's.
				errs = append(errs, fmt.Errorf("lease %s in namespace %s: Secret %s is not a lease Secret (type %s); left alone", id, r.Namespace, r.Secret, secretType(s)))
				continue
			}
			bindingErr, err := d.Revoke(ctx, s)
			switch {
			case errors.Is(err, lease.ErrGone):
				errs = append(errs, fmt.Errorf("lease %s in namespace %s: deleted meanwhile (expired or revoked by someone else)", id, r.Namespace))
				continue
			case apierrors.IsConflict(err):
				// Its UID changed since the listing: another Secret under
				// its name, not this lease. The other namespaces go on.
				errs = append(errs, fmt.Errorf("lease %s in namespace %s: the Secret was replaced since it was listed; left alone", id, r.Namespace))
				continue
			case err != nil:
				return errors.Join(append(errs, explainAPIError(err, "delete", r.Namespace))...)
			}
			fmt.Fprintf(out, "revoked lease %s: %s/%s held by peer %s (%s), issued %s; Secret %s deleted, the API server rejects its token within about 10s\n",
				r.ID, r.Namespace, r.ServiceAccount, orNone(r.Peer), orNone(r.Identity), ago(now, r.CreatedAt), r.Secret)
			if bindingErr != nil && !errors.Is(bindingErr, lease.ErrNotOwned) {
				fmt.Fprintf(out, "warning: lease %s: its RoleBinding was not deleted (%v); the garbage collector deletes it with the Secret\n", r.ID, bindingErr)
			}
		}
	}
	return errors.Join(errs...)
}

// secretsNamed lists the Secrets named name in namespace ("" for every
// namespace): a lease is looked up by its name, which holds its id, not by
// its lease-id label, which whoever may patch the Secret can strip. Any
// type: one of another type is reported and left alone.
func secretsNamed(ctx context.Context, secrets corev1client.SecretsGetter, namespace, name string) ([]corev1.Secret, error) {
	list, err := secrets.Secrets(namespace).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		return nil, err
	}
	out := list.Items[:0]
	for _, s := range list.Items {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out, nil
}

// secretType is s's type as an error message shows it.
func secretType(s *corev1.Secret) string {
	if s == nil {
		return "unknown"
	}
	return string(s.Type)
}
