package lease

import (
	"context"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/metadata"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// ToAPI is the lease that Secret s records, as the API answers it. Its id
// is the one in its name, which a lookup by id finds (Store.Find), not its
// lease-id label, which anyone who may patch the Secret can change.
func ToAPI(s *corev1.Secret) apiv1.Lease {
	exp, _ := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt])
	id := IDOf(s.Name)
	if id == "" {
		id = s.Labels[objects.LabelLeaseID]
	}
	return apiv1.Lease{
		ID:             id,
		Peer:           s.Labels[objects.LabelPeer],
		Namespace:      s.Namespace,
		ServiceAccount: s.Annotations[objects.AnnotationSA],
		User:           s.Annotations[objects.AnnotationUser],
		Workload:       s.Annotations[objects.AnnotationWorkload],
		Credential:     s.Annotations[objects.AnnotationCred],
		CreatedAt:      s.CreationTimestamp.UTC(),
		ExpiresAt:      exp.UTC(),
		Grant:          s.Annotations[objects.AnnotationGrant],
		Access:         s.Annotations[objects.AnnotationAccess],
	}
}

// Record is one lease as "leases -o json" prints it: the fields of
// GET /v1/leases (so that one jq filter reads both) and the holder's
// identity and Secret.
type Record struct {
	ID             string     `json:"id"`
	Peer           string     `json:"peer"`
	Identity       string     `json:"identity"`
	Namespace      string     `json:"namespace"`
	ServiceAccount string     `json:"serviceAccount"`
	User           string     `json:"user,omitempty"`
	Workload       string     `json:"workload,omitempty"`
	Credential     string     `json:"credential"`
	CreatedAt      time.Time  `json:"createdAt"`
	ExpiresAt      *time.Time `json:"expiresAt,omitempty"`
	Expired        bool       `json:"expired"`
	Secret         string     `json:"secret"`
	// Grant is the grant the lease was issued under (AnnotationGrant).
	Grant string `json:"grant,omitempty"`
	// CredentialID is the credential as the API server's audit log names
	// it (AnnotationCredentialID), once it is issued.
	CredentialID string `json:"credentialId,omitempty"`
	// UID is the Secret's, for a delete with a precondition.
	UID types.UID `json:"-"`
}

// ListSecrets lists the lease Secrets in namespace ("" for every
// namespace) whose labels also match extra, with whatever credentials
// secrets has: "tokenbroker leases" lists as the administrator, not as the
// broker. It holds them all: for lookups by lease id; walk a whole cluster
// with EachSecretPage.
func ListSecrets(ctx context.Context, secrets corev1client.SecretsGetter, namespace string, extra labels.Set) ([]corev1.Secret, error) {
	var out []corev1.Secret
	err := EachSecretPage(ctx, secrets, namespace, extra, func(page []corev1.Secret) error {
		out = append(out, page...)
		return nil
	})
	return out, err
}

// SecretPageSize is the page size of EachSecretPage.
const SecretPageSize = 500

// EachSecretPage is ListSecrets one page of the API server's at
// a time (ListOptions Limit/Continue, SecretPageSize): fn gets each
// page in the API server's order (namespace, then Secret name), and no more
// than one page is held. It stops at fn's first error and returns it.
func EachSecretPage(ctx context.Context, secrets corev1client.SecretsGetter, namespace string, extra labels.Set, fn func([]corev1.Secret) error) error {
	set := labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind}
	for k, v := range extra {
		set[k] = v
	}
	return eachPage(func(opts metav1.ListOptions) (*corev1.SecretList, error) {
		return secrets.Secrets(namespace).List(ctx, opts)
	}, labels.SelectorFromSet(set).String(), fn)
}

// eachPage lists the Secrets matching selector through list, a page of
// SecretPageSize at a time, and hands each page to fn; it stops at the
// first error of either.
func eachPage(list func(metav1.ListOptions) (*corev1.SecretList, error), selector string, fn func([]corev1.Secret) error) error {
	opts := metav1.ListOptions{LabelSelector: selector, Limit: SecretPageSize}
	for {
		page, err := list(opts)
		if err != nil {
			return err
		}
		if err := fn(page.Items); err != nil {
			return err
		}
		if page.Continue == "" {
			return nil
		}
		opts.Continue = page.Continue
	}
}

// Records turns lease Secrets into records, keeps those of
// serviceAccount if it is set, and sorts them by namespace, ServiceAccount,
// issue time and id.
func Records(secrets []corev1.Secret, serviceAccount string, now time.Time) []Record {
	out := make([]Record, 0, len(secrets))
	for i := range secrets {
		s := &secrets[i]
		l := ToAPI(s)
		r := Record{
			ID: l.ID, Peer: l.Peer, Namespace: l.Namespace, ServiceAccount: l.ServiceAccount, User: l.User, Workload: l.Workload,
			Credential: l.Credential, CreatedAt: l.CreatedAt,
			Identity: s.Annotations[objects.AnnotationIdentity], Secret: s.Name, UID: s.UID, Grant: l.Grant,
			CredentialID: s.Annotations[objects.AnnotationCredentialID],
		}
		if serviceAccount != "" && r.ServiceAccount != serviceAccount {
			continue
		}
		if exp, err := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt]); err == nil {
			exp = exp.UTC()
			r.ExpiresAt = &exp
			r.Expired = !now.Before(exp)
		}
		out = append(out, r)
	}
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.ServiceAccount != b.ServiceAccount {
			return a.ServiceAccount < b.ServiceAccount
		}
		if !a.CreatedAt.Equal(b.CreatedAt) {
			return a.CreatedAt.Before(b.CreatedAt)
		}
		return a.ID < b.ID
	})
	return out
}

// EachSecretMetadataPage is EachSecretPage over every namespace
// with the metadata client: the lease Secrets' metadata only (labels,
// annotations, creation time; never their data), of the type
// SecretTypeLease only (a field selector the API server applies, so a
// Secret of another type that copies the labels is not listed). Each
// Secret fn gets has its ObjectMeta and Type set, nothing else.
func EachSecretMetadataPage(ctx context.Context, client metadata.Interface, fn func([]corev1.Secret) error) error {
	opts := metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind}).String(),
		FieldSelector: TypeSelector,
		Limit:         SecretPageSize,
	}
	for {
		list, err := client.Resource(SecretsGVR).Namespace(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return err
		}
		page := make([]corev1.Secret, len(list.Items))
		for i := range list.Items {
			page[i] = corev1.Secret{ObjectMeta: list.Items[i].ObjectMeta, Type: objects.SecretTypeLease}
		}
		if err := fn(page); err != nil {
			return err
		}
		if list.Continue == "" {
			return nil
		}
		opts.Continue = list.Continue
	}
}
