package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/rbacrights"
)

// auditOptions is the typed configuration of "tokenbroker audit".
type auditOptions struct {
	APIAuditLog     string
	BrokerAuditLogs []string
	Kubeconfig      string
	Context         string
	Since           string
	Lease           string
	Peer            string
	Output          string
	Summary         bool
	// MaxGatewayRequests bounds the lease gateway's requests indexed.
	MaxGatewayRequests int

	since time.Time
}

var auditOutputs = []string{"table", "json"}

func newAuditCommand() *cobra.Command {
	var o auditOptions
	cmd := &cobra.Command{
		Use:   "audit --api-audit-log FILE (--broker-audit-log FILE... | --kubeconfig FILE) [--lease ID] [--peer NAME] [--since 2h] [--summary] [-o table|json]",
		Short: "Who used a credential: join a target API server's audit log to the broker's leases (admin)",
		Long: `Read a target API server's audit log (audit.k8s.io/v1 events, JSON lines, the
file of --audit-log-path; "-" for standard input) and print every request made
with a credential the broker issued: when, the verb, resource, namespace and
response code, and the lease, its peer, the source workload and the broker
request that minted it.

The API server names the credential of every authenticated request in
user.extra["authentication.kubernetes.io/credential-id"] ("JTI=<jti>" for a
token, "X509SHA256=<fingerprint>" for a client certificate). The broker records
the same id as credential_id in its audit events and on each lease Secret
(annotation ` + objects.AnnotationCredentialID + `). Give the broker's audit
events with --broker-audit-log (its standard output or --audit-log file;
operational log lines are skipped; repeat the flag for several replicas or
days), or read the live lease Secrets with --kubeconfig (leases are deleted
at expiry and revocation, so only live leases join that way), or both.
How far back the join reaches is how long the broker's audit events are kept.

What the join trusts: the broker's issue events win; a lease Secret never
overrides one, and between Secrets the earliest created wins. Refused
claims are counted on standard error and their leases marked disputed
(STATE ",disputed"). A request is joined only if its user is the lease's
subject (system:serviceaccount:<namespace>:<name>, or the certificate's
per-lease user); others are counted. Leases known only from their Secrets
(STATE ",secret", JSON "source":"secret") are trusted only as far as the
lease admission policy (deploy/components/lease-admission-policy) reserves
lease Secrets for the broker: without it anyone who may create Secrets can
forge one. Only the metadata of Secrets of type tokenbroker.io/lease is read.

A request that fails authentication carries no credential id and cannot be
attributed: a revoked token's later requests are 401s counted at the end, not
rows. A revoked client certificate still authenticates: its later requests
are 403 rows with the state "revoked".

--summary prints, per lease, what it was used for (verb x resource, with
counts and refusals), and per grant and RBAC subject the permissions the
subject has and never used: read with --kubeconfig from the
ClusterRoleBindings (their rules apply in every namespace) and the
RoleBindings of every namespace (theirs only there, listed "in <namespace>"),
bindings to system:authenticated left out, subjects matched as the RBAC
authorizer matches them. Without --kubeconfig they are "unknown".
A request is refused when its authorization.k8s.io/decision annotation is
"forbid" (else when its code is 403); an impersonating request (column
IMPERSONATING) uses only the right to impersonate. bind, escalate,
approve, sign, impersonate and create on pods/exec, attach and portforward
never show as requests: they are listed as "not observable in the audit
log". At most 4096 distinct permissions are kept per lease and subject;
the rest are counted as other requests.

A request forwarded by the lease gateway reaches the API server with the
gateway's credential; it is joined to its lease by the Audit-Id the gateway
sent and recorded as api_audit_id in its gateway_forward and gateway_upgrade
events (written while a watch, an exec or a followed log runs) and its
gateway_request event (when the request ends): one request, however many of
them were read. A stream whose replica died, or whose end is past the broker
log read, still joins by its gateway_forward event. At most
--max-gateway-requests gateway requests are indexed (about 150 bytes each);
the events of requests past it are counted on standard error, never dropped
silently: those requests' API server events cannot be joined.

ISSUE-REQUEST is the X-Request-Id the client sent with its issuance: the
peer chooses it. Find the issuance in the broker's log by the lease id.

The log is streamed: any size, one line (at most 1 MiB; longer lines are
skipped and counted) at a time. Counts go to standard error at the end.
-o json prints one JSON object per line. In the table and the summary, a
field with a control character, invalid UTF-8, a space or a quote (names
come from request URLs, Secrets and RBAC objects) is printed quoted and
Go-escaped ("a\x20b", "x\x1b[2K"): one request is always one line.
Reading Secrets and RBAC needs list on secrets (their metadata only) in
every namespace, list on rolebindings in every namespace, and list/get on
roles, clusterroles and clusterrolebindings; nothing is written.`,
		Example: `  # every request made with a broker credential, joined with the broker's audit events
  tokenbroker audit --api-audit-log /var/log/kubernetes/audit.log --broker-audit-log broker-audit.jsonl

  # the same from the pods' logs, for one peer, over the last two hours
  kubectl -n tokenbroker logs -l app.kubernetes.io/name=tokenbroker --tail=-1 --prefix=false > broker.log
  tokenbroker audit --api-audit-log audit.log --broker-audit-log broker.log --peer west --since 2h

  # the live leases, read from their Secrets; the audit log on stdin
  zcat audit.log.gz | tokenbroker audit --api-audit-log - --kubeconfig ~/.kube/east

  # what one lease was used for, and the permissions its grant never used
  tokenbroker audit --api-audit-log audit.log --broker-audit-log broker.log --kubeconfig ~/.kube/east --lease q3fcxb7kumyz4pa2m6dxx5jnle --summary`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.validate(time.Now()); err != nil {
				return err
			}
			var (
				client kubernetes.Interface
				meta   metadata.Interface
			)
			if o.Kubeconfig != "" {
				rc, err := restConfig(o.Kubeconfig, o.Context)
				if err != nil {
					return err
				}
				rc.QPS, rc.Burst = leasesKubeQPS, leasesKubeBurst
				if client, err = kubernetes.NewForConfig(rc); err != nil {
					return fmt.Errorf("create Kubernetes client: %w", err)
				}
				if meta, err = metadata.NewForConfig(rc); err != nil {
					return fmt.Errorf("create Kubernetes metadata client: %w", err)
				}
			}
			return runAudit(cmd.Context(), o, auditClients{kube: client, meta: meta}, cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.APIAuditLog, "api-audit-log", "", `the target API server's audit log (JSON lines of audit.k8s.io/v1 events), "-" for standard input`)
	fs.StringArrayVar(&o.BrokerAuditLogs, "broker-audit-log", nil, `a file of the broker's audit events (its output; other lines are skipped), "-" for standard input; repeatable`)
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "a kubeconfig of the target cluster: read its live lease Secrets, and with --summary its RBAC")
	fs.StringVar(&o.Context, "context", "", "kubeconfig context to use (default: its current context)")
	fs.StringVar(&o.Since, "since", "", `only requests received since this time: RFC 3339 ("2030-01-02T15:04:05Z") or a duration before now ("2h")`)
	fs.StringVar(&o.Lease, "lease", "", "only the requests made with this lease's credential")
	fs.StringVar(&o.Peer, "peer", "", "only the requests made with credentials of this peer (its name in the policy)")
	fs.StringVarP(&o.Output, "output", "o", "table", "output format: table or json (one object a line)")
	fs.BoolVar(&o.Summary, "summary", false, "per lease, the verbs and resources used; per grant and subject, the permissions never used")
	fs.IntVar(&o.MaxGatewayRequests, "max-gateway-requests", auditjoin.DefaultMaxGatewayRequests,
		"at most this many lease gateway requests are indexed (about 150 bytes each); those past it are counted, and their API server events are not joined")
	_ = cmd.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(auditOutputs, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

func (o *auditOptions) validate(now time.Time) error {
	if o.APIAuditLog == "" {
		return errors.New("--api-audit-log is required: the target API server's audit log file (its --audit-log-path), or - for standard input")
	}
	if len(o.BrokerAuditLogs) == 0 && o.Kubeconfig == "" {
		return errors.New("give the broker's audit events (--broker-audit-log FILE) or a kubeconfig to read the live lease Secrets (--kubeconfig FILE), or both")
	}
	stdin := 0
	for _, f := range append([]string{o.APIAuditLog}, o.BrokerAuditLogs...) {
		if f == "-" {
			stdin++
		}
		if f == "" {
			return errors.New("--broker-audit-log needs a file name")
		}
	}
	if stdin > 1 {
		return errors.New(`only one input can be standard input ("-")`)
	}
	if o.Lease != "" && !apiv1.ValidLeaseID(o.Lease) {
		return fmt.Errorf("--lease %q is not a lease id (26 characters a-z, 2-7, as \"tokenbroker leases\" shows them)", o.Lease)
	}
	if len(o.Peer) > 253 {
		return errors.New("--peer is longer than 253 characters: not a peer name")
	}
	if !slices.Contains(auditOutputs, o.Output) {
		return fmt.Errorf("--output must be one of %s, not %q", strings.Join(auditOutputs, ", "), o.Output)
	}
	if o.Since != "" {
		t, err := parseSince(o.Since, now)
		if err != nil {
			return err
		}
		o.since = t
	}
	if o.MaxGatewayRequests < 1 {
		return fmt.Errorf("--max-gateway-requests must be at least 1, not %d", o.MaxGatewayRequests)
	}
	return nil
}

// parseSince is an RFC 3339 time or a positive duration before now.
func parseSince(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return time.Time{}, fmt.Errorf(`--since %q is neither an RFC 3339 time ("2030-01-02T15:04:05Z") nor a positive duration ("2h")`, s)
	}
	return now.Add(-d), nil
}

// openInput opens a log file, or returns stdin for "-". Only regular
// files, pipes and standard input are read.
func openInput(name string, stdin io.Reader) (io.ReadCloser, error) {
	if name == "-" {
		return io.NopCloser(stdin), nil
	}
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	if fi.IsDir() {
		_ = f.Close()
		return nil, fmt.Errorf("%s is a directory, not a log file", name)
	}
	return f, nil
}

// auditClients are the clients of --kubeconfig: nil without it. meta
// lists the lease Secrets' metadata, kube reads RBAC.
type auditClients struct {
	kube kubernetes.Interface
	meta metadata.Interface
}

func runAudit(ctx context.Context, o auditOptions, clients auditClients, stdin io.Reader, out, errOut io.Writer) error {
	client := clients.kube
	var opts []auditjoin.IndexOption
	if o.MaxGatewayRequests > 0 { // else the default
		opts = append(opts, auditjoin.WithMaxGatewayRequests(o.MaxGatewayRequests))
	}
	idx := auditjoin.NewIndex(opts...)
	for _, name := range o.BrokerAuditLogs {
		f, err := openInput(name, stdin)
		if err != nil {
			return fmt.Errorf("open broker audit log: %w", err)
		}
		st, err := idx.ReadBrokerLog(f)
		_ = f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if st.TooLong > 0 || st.Malformed > 0 {
			fmt.Fprintf(errOut, "%s: skipped %d lines over %d bytes and %d broken audit events\n", name, st.TooLong, auditjoin.MaxLineBytes, st.Malformed)
		}
	}
	if clients.meta != nil {
		err := lease.EachSecretMetadataPage(ctx, clients.meta, func(page []corev1.Secret) error {
			for _, r := range lease.Records(page, "", time.Now()) {
				l := auditjoin.Lease{
					ID: r.ID, Peer: r.Peer, Identity: r.Identity, Namespace: r.Namespace, ServiceAccount: r.ServiceAccount,
					User: r.User, Workload: r.Workload, Credential: r.Credential, Grant: r.Grant, CredentialID: r.CredentialID,
					IssuedAt: r.CreatedAt,
				}
				if r.ExpiresAt != nil {
					l.ExpiresAt = *r.ExpiresAt
				}
				idx.AddLease(l)
			}
			return nil
		})
		if err != nil {
			return explainAPIError(err, "list", "")
		}
	}
	if n, notes := idx.Conflicts(); n > 0 {
		fmt.Fprintf(errOut, "warning: %d claims of a lease id, credential id or gateway api_audit_id were refused (a forged lease Secret or broker event; the broker's issue event wins, then the earliest created Secret; the first gateway event of an api_audit_id); their leases are marked disputed:\n", n)
		for _, note := range notes {
			fmt.Fprintf(errOut, "  %s\n", printableText(note))
		}
	}
	if idx.Len() == 0 {
		fmt.Fprintln(errOut, "warning: no lease with a credential id was found: nothing can be joined (broker audit events without credential_id name only tokens, by token_jti)")
	}

	f, err := openInput(o.APIAuditLog, stdin)
	if err != nil {
		return fmt.Errorf("open API server audit log: %w", err)
	}
	defer f.Close()
	filter := auditjoin.Filter{LeaseID: o.Lease, Peer: o.Peer, Since: o.since}
	var (
		st      auditjoin.Stats
		printed int
	)
	if o.Summary {
		sum := auditjoin.NewSummary()
		st, err = auditjoin.Join(f, idx, filter, func(r auditjoin.Row) error {
			printed++
			sum.Add(r)
			return nil
		})
		if err != nil {
			return err
		}
		if err := printSummary(ctx, out, o.Output, sum, client); err != nil {
			return err
		}
		if n := sum.Overflow(); n > 0 {
			fmt.Fprintf(errOut, "warning: %d requests were for permissions past the first %d distinct ones of their lease or subject: counted as other requests, not told apart\n", n, auditjoin.MaxPermissions)
		}
	} else {
		p := &rowPrinter{out: out, json: o.Output == "json"}
		st, err = auditjoin.Join(f, idx, filter, func(r auditjoin.Row) error {
			printed++
			return p.row(r)
		})
		if flushErr := p.flush(); err == nil {
			err = flushErr
		}
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(errOut, "%d requests read, %d made with a broker credential, %d selected; %d refused authentication (401) and carry no credential id, so cannot be attributed (a revoked or expired token's requests are among them); %d made with credentials of no known lease\n",
		st.Requests, st.Joined, printed, st.Unauthenticated, st.NoLease)
	if st.WrongUser > 0 {
		fmt.Fprintf(errOut, "warning: %d requests name a lease's credential id but were made by another user than the lease's subject: not joined (a forged lease Secret, or an authenticator that lets clients set user.extra)\n", st.WrongUser)
	}
	if st.FromSecret > 0 {
		fmt.Fprintf(errOut, "note: %d of the joined requests are of leases known only from their lease Secrets (source \"secret\"), not from the broker's audit events: trusted only as far as the lease admission policy reserves lease Secrets for the broker\n", st.FromSecret)
	}
	if st.Disputed > 0 {
		fmt.Fprintf(errOut, "warning: %d of the joined requests are of disputed leases (STATE ends in \",disputed\")\n", st.Disputed)
	}
	gw := idx.Gateway()
	if st.Gateway > 0 {
		fmt.Fprintf(errOut, "%d of the joined requests came through the lease gateway, joined by the api_audit_id of its events", st.Gateway)
		if st.GatewayOpen > 0 {
			fmt.Fprintf(errOut, "; %d of them known only from the start of their stream (gateway_forward or gateway_upgrade, no gateway_request: the replica died mid-stream, or the broker log ends before the stream did)", st.GatewayOpen)
		}
		fmt.Fprintln(errOut)
	}
	if gw.NotIndexed > 0 {
		fmt.Fprintf(errOut, "warning: at least %d gateway requests not indexed (over the limit of %d; %d gateway events skipped): their API server events are unjoined, among those made with credentials of no known lease; raise --max-gateway-requests (about 150 bytes each) or give fewer broker logs at a time\n",
			gw.NotIndexed, gw.Limit, gw.NotIndexedEvents)
	}
	if gw.BadAuditID > 0 {
		fmt.Fprintf(errOut, "warning: %d gateway events have an api_audit_id over %d bytes (the gateway's are UUIDs): skipped\n", gw.BadAuditID, auditjoin.MaxAuditIDBytes)
	}
	if st.Duplicates > 0 {
		fmt.Fprintf(errOut, "%d events repeated an audit id already read (overlapping log files) and were counted once\n", st.Duplicates)
	}
	if st.TooLong > 0 || st.Malformed > 0 {
		fmt.Fprintf(errOut, "%s: skipped %d lines over %d bytes and %d lines that are not audit events\n", o.APIAuditLog, st.TooLong, auditjoin.MaxLineBytes, st.Malformed)
	}
	return nil
}

// auditTablePage is how many rows the table aligns at a time: the output
// streams, so the columns line up within a page.
const auditTablePage = 500

type rowPrinter struct {
	out  io.Writer
	json bool
	tw   *tabwriter.Writer
	n    int
}

func (p *rowPrinter) row(r auditjoin.Row) error {
	if p.json {
		b, err := json.Marshal(r)
		if err != nil {
			return err
		}
		_, err = p.out.Write(append(b, '\n'))
		return err
	}
	if p.tw == nil {
		p.tw = tabwriter.NewWriter(p.out, 0, 8, 2, ' ', 0)
		if p.n == 0 {
			fmt.Fprintln(p.tw, "TIME\tVERB\tRESOURCE\tNAMESPACE\tNAME\tCODE\tLEASE\tSTATE\tPEER\tWORKLOAD\tISSUE-REQUEST\tIMPERSONATING")
		}
	}
	fmt.Fprintln(p.tw, strings.Join([]string{
		r.Time.UTC().Format(time.RFC3339), printableNone(r.Verb), printableNone(resourceOf(r)), printableNone(r.Namespace), printableNone(r.Name),
		strconv.Itoa(r.Code), printableNone(r.Lease.ID), printableNone(stateOf(r)), printableNone(r.Lease.Peer), printableNone(r.Lease.Workload),
		printableNone(r.Lease.IssueRequestID), printableNone(r.ImpersonatedUser),
	}, "\t"))
	p.n++
	if p.n%auditTablePage == 0 {
		return p.flush()
	}
	return nil
}

// stateOf is the STATE column: the lease's state, ",disputed" when
// another source claims its lease id or credential id, ",secret" when it
// is known only from its lease Secret.
func stateOf(r auditjoin.Row) string {
	s := r.LeaseState
	if r.Lease.Disputed {
		s += ",disputed"
	}
	if r.Lease.Source == auditjoin.SourceSecret {
		s += ",secret"
	}
	return s
}

func (p *rowPrinter) flush() error {
	if p.tw == nil {
		return nil
	}
	err := p.tw.Flush()
	p.tw = nil
	return err
}

// resourceOf is "group/resource/subresource" (the core group without
// "group/"), or the path of a non-resource request.
func resourceOf(r auditjoin.Row) string {
	if r.Resource == "" {
		return r.Path
	}
	s := r.Resource
	if r.Subresource != "" {
		s += "/" + r.Subresource
	}
	if r.Group != "" {
		s = r.Group + "/" + s
	}
	return s
}

// subjectReport is one grant and subject of the summary, with the
// permissions it has and never used.
type subjectReport struct {
	Kind string `json:"kind"`
	auditjoin.SubjectUsage
	// Permissions is "known" (read from RBAC), "unbound" (no binding names
	// the subject any more) or "unknown" (no --kubeconfig).
	Permissions string                 `json:"permissions"`
	Bindings    []string               `json:"bindings,omitempty"`
	Unused      []auditjoin.Permission `json:"unused"`
	// NotObservable are permissions whose use the audit log cannot show
	// (bind, escalate, approve, sign, impersonate, create on pods/exec,
	// attach and portforward): neither used nor unused.
	NotObservable []auditjoin.Permission `json:"notObservable,omitempty"`
}

type leaseReport struct {
	Kind string `json:"kind"`
	auditjoin.LeaseUsage
}

func printSummary(ctx context.Context, out io.Writer, format string, sum *auditjoin.Summary, client kubernetes.Interface) error {
	var resolver *rbacrights.Resolver
	if client != nil {
		resolver = rbacrights.NewResolver(client.RbacV1())
	}
	var subjects []subjectReport
	for _, s := range sum.Subjects() {
		rep := subjectReport{Kind: "subject", SubjectUsage: s, Permissions: "unknown", Unused: []auditjoin.Permission{}}
		if resolver != nil {
			sub := rbacrights.Subject{Username: s.Subject.String()}
			if s.Subject.Kind == auditjoin.SubjectServiceAccount {
				sub.Groups = rbacrights.ServiceAccountGroups(s.Subject.Namespace)
			}
			grants, err := resolver.Grants(ctx, sub)
			if err != nil {
				return fmt.Errorf("read the RBAC of %s: %w", printable(s.Subject.String()), err)
			}
			rep.Permissions = "unbound"
			for _, g := range grants {
				rep.Permissions = "known"
				rep.Bindings = append(rep.Bindings, g.From...)
				unused, unobservable := auditjoin.UnusedIn(g.Namespace, g.Rules, s.Uses)
				rep.Unused = append(rep.Unused, unused...)
				rep.NotObservable = append(rep.NotObservable, unobservable...)
			}
		}
		subjects = append(subjects, rep)
	}
	if format == "json" {
		enc := json.NewEncoder(out)
		for _, l := range sum.Leases() {
			if err := enc.Encode(leaseReport{Kind: "lease", LeaseUsage: l}); err != nil {
				return err
			}
		}
		for _, s := range subjects {
			if err := enc.Encode(s); err != nil {
				return err
			}
		}
		return nil
	}
	for _, l := range sum.Leases() {
		fmt.Fprintf(out, "LEASE %s  %s, peer %s, %s%s\n", printableNone(l.Lease.ID), printableNone(l.Lease.Credential), printableNone(l.Lease.Peer),
			printableNone(l.Subject.String()), leaseMarks(l.Lease))
		fmt.Fprintf(out, "  workload %s, issued %s by request %s, %s\n", printableNone(l.Lease.Workload), timeOrUnknown(l.Lease.IssuedAt),
			printableNone(l.Lease.IssueRequestID), leaseEnd(l.Lease))
		fmt.Fprintf(out, "  %d requests from %s to %s, %d after revocation\n", l.Requests,
			l.First.UTC().Format(time.RFC3339), l.Last.UTC().Format(time.RFC3339), l.AfterRevocation)
		if err := printUses(out, l.Uses); err != nil {
			return err
		}
		if l.OtherRequests > 0 {
			fmt.Fprintf(out, "  and %d requests for other permissions (past the first %d)\n", l.OtherRequests, auditjoin.MaxPermissions)
		}
		fmt.Fprintln(out)
	}
	for _, s := range subjects {
		fmt.Fprintf(out, "GRANT %s  %s, %d leases, %d requests\n", printableNone(s.Grant), printableNone(s.Subject.String()), len(s.Leases), s.Requests)
		switch s.Permissions {
		case "unknown":
			fmt.Fprintln(out, "  permissions unknown: give --kubeconfig to read the subject's RBAC")
		case "unbound":
			fmt.Fprintln(out, "  no RBAC binding names this subject now (a client certificate's RoleBinding goes with its lease)")
		default:
			names := make([]string, len(s.Bindings))
			for i, b := range s.Bindings {
				names[i] = printable(b)
			}
			fmt.Fprintf(out, "  bound by %s\n", strings.Join(names, ", "))
			if len(s.Unused) == 0 {
				fmt.Fprintln(out, "  every permission the audit log can show was used")
			} else {
				fmt.Fprintf(out, "  never used: %s\n", printablePermissions(s.Unused))
			}
			if len(s.NotObservable) > 0 {
				fmt.Fprintf(out, "  not observable in the audit log: %s\n", printablePermissions(s.NotObservable))
			}
			if s.OtherRequests > 0 {
				fmt.Fprintf(out, "  %d requests for permissions past the first %d are not told apart: \"never used\" may list some of them\n",
					s.OtherRequests, auditjoin.MaxPermissions)
			}
		}
		fmt.Fprintln(out)
	}
	return nil
}

func printablePermissions(ps []auditjoin.Permission) string {
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = printablePermission(p)
	}
	return strings.Join(names, ", ")
}

func printUses(out io.Writer, uses []auditjoin.Use) error {
	tw := tabwriter.NewWriter(out, 0, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "  VERB\tRESOURCE\tREQUESTS\tDENIED")
	for _, u := range uses {
		res := u.Path
		if res == "" {
			res = u.Resource
			if u.Group != "" {
				res = u.Group + "/" + res
			}
		}
		fmt.Fprintf(tw, "  %s\t%s\t%d\t%d\n", printableNone(u.Verb), printableNone(res), u.Count, u.Denied)
	}
	return tw.Flush()
}

// leaseMarks is what the summary says of a lease's source and disputes.
func leaseMarks(l auditjoin.Lease) string {
	var s string
	if l.Source == auditjoin.SourceSecret {
		s += " (known only from its lease Secret)"
	}
	if l.Disputed {
		s += " (DISPUTED: another lease Secret or event claims its id or credential)"
	}
	return s
}

func timeOrUnknown(t time.Time) string {
	if t.IsZero() {
		return "<unknown>"
	}
	return t.UTC().Format(time.RFC3339)
}

func leaseEnd(l auditjoin.Lease) string {
	switch {
	case !l.RevokedAt.IsZero():
		return "revoked " + l.RevokedAt.UTC().Format(time.RFC3339) + " (" + printableText(l.RevokeReason) + ")"
	case !l.ExpiresAt.IsZero():
		return "expires " + l.ExpiresAt.UTC().Format(time.RFC3339)
	}
	return "expiry unknown"
}
