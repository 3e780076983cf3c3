package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/tokenbroker/tokenbroker/broker/enrollment"
)

// revokeOptions is the typed configuration of "tokenbroker pki revoke".
type revokeOptions struct {
	Identity   string
	Serial     string
	PodUID     string
	Reason     string
	List       bool
	Kubeconfig string
	Namespace  string
}

// newPKIRevokeCommand returns `tokenbroker pki revoke`: add an identity or
// a certificate serial to the deny list that every broker replica watches,
// or list it.
func newPKIRevokeCommand() *cobra.Command {
	var o revokeOptions
	cmd := &cobra.Command{
		Use:   "revoke (--identity SPIFFE-ID | --serial HEX | --pod-uid UID | --list)",
		Short: "Revoke a cluster or workload identity, a certificate serial or a Pod at the brokers of this cluster",
		Long: `Add a cluster identity, a workload identity, one certificate's serial number
or one Pod's uid to the revocation deny list, the ConfigMap ` + enrollment.RevocationConfigMap + ` in the
broker's namespace. Every broker replica watches it and refuses a revoked
caller on its next request, keep-alive connections included, within a second
or two; a revoked cluster identity can no longer enroll or renew either.

A workload identity (spiffe://<trust-domain>/cluster/<name>/ns/<namespace>/sa/<sa>)
refuses the pod certificates of every Pod of that ServiceAccount; --pod-uid
those of one Pod (its uid in the source cluster: kubectl get pod NAME -o
jsonpath='{.metadata.uid}'); the serial of a cluster CA every pod certificate
it signed.

Serials are hexadecimal as "GET /v1/whoami" and "tokenbroker pki inspect" show
them; openssl's colon-separated form is accepted. The ConfigMap is created if
it is missing and updated with retries if another writer changed it. Entries
are removed by editing the ConfigMap (kubectl edit).

Uses --kubeconfig, else $KUBECONFIG, else ~/.kube/config, else the in-cluster
service account; the caller needs get, create and update on ConfigMaps in
--namespace.`,
		Example: `  tokenbroker pki revoke --identity spiffe://oc.example/cluster/west --reason "key leaked"
  tokenbroker pki revoke --serial 3f:9a:0c:... --namespace tokenbroker
  tokenbroker pki revoke --pod-uid 6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54 --reason "compromised"
  tokenbroker pki revoke --list`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.validate(); err != nil {
				return err
			}
			o.Namespace = namespaceOrDefault(o.Namespace)
			cms, err := revocationConfigMaps(o.Kubeconfig, o.Namespace)
			if err != nil {
				return err
			}
			return runPKIRevoke(cmd.Context(), cms, o, cmd.OutOrStdout(), time.Now)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.Identity, "identity", "", "cluster identity to revoke, spiffe://<trust-domain>/cluster/<name>, or workload identity, .../ns/<namespace>/sa/<serviceAccount>")
	fs.StringVar(&o.Serial, "serial", "", "serial number (hex) of one certificate to revoke")
	fs.StringVar(&o.PodUID, "pod-uid", "", "uid of one Pod of a source cluster whose pod certificates to revoke")
	fs.StringVar(&o.Reason, "reason", "", "why, kept with the entry as a comment")
	fs.BoolVar(&o.List, "list", false, "print the deny list instead of changing it")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "kubeconfig of the cluster the brokers run in")
	fs.StringVar(&o.Namespace, "namespace", "", "the brokers' namespace; default $POD_NAMESPACE, else "+defaultNamespace)
	return cmd
}

func (o revokeOptions) validate() error {
	n := 0
	for _, set := range []bool{o.Identity != "", o.Serial != "", o.PodUID != "", o.List} {
		if set {
			n++
		}
	}
	if n != 1 {
		return errors.New("give exactly one of --identity, --serial, --pod-uid and --list")
	}
	if o.List && o.Reason != "" {
		return errors.New("--reason goes with --identity, --serial or --pod-uid")
	}
	return nil
}

// revocationConfigMaps returns the ConfigMaps client of namespace with the
// caller's Kubernetes credentials.
func revocationConfigMaps(kubeconfig, namespace string) (corev1client.ConfigMapInterface, error) {
	client, err := adminClient(kubeconfig, "", nil)
	if err != nil {
		return nil, err
	}
	return client.CoreV1().ConfigMaps(namespace), nil
}

// runPKIRevoke adds the entry o asks for to the deny list in cms, or lists
// the deny list, and reports to out.
func runPKIRevoke(ctx context.Context, cms corev1client.ConfigMapInterface, o revokeOptions, out io.Writer, now func() time.Time) error {
	if o.List {
		entries, problems, err := enrollment.ReadRevocations(ctx, cms)
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "KIND\tVALUE\tCOMMENT")
		for _, e := range entries {
			fmt.Fprintf(tw, "%s\t%s\t%s\n", e.Kind, e.Value, e.Comment)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		for _, p := range problems {
			fmt.Fprintln(out, "skipped invalid entry:", p)
		}
		return nil
	}
	kind, value := enrollment.RevokeIdentity, o.Identity
	switch {
	case o.Serial != "":
		kind, value = enrollment.RevokeSerial, o.Serial
	case o.PodUID != "":
		kind, value = enrollment.RevokePod, o.PodUID
	}
	added, err := enrollment.AddRevocation(ctx, cms, kind, value, o.Reason, now())
	if err != nil {
		return err
	}
	if !added {
		_, err = fmt.Fprintf(out, "%s %s was already revoked\n", kind, value)
		return err
	}
	_, err = fmt.Fprintf(out, "revoked %s %s (ConfigMap %s); brokers refuse it from their next request\n", kind, value, enrollment.RevocationConfigMap)
	return err
}
