package agent

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/tokenbroker/tokenbroker/broker"
)

// Labels and annotations on the Secrets the agent writes. The annotations
// let a restarted agent find the credential it wrote (and its lease) and
// schedule from it instead of fetching at once.
const (
	// LabelManagedBy marks the Secrets the agent owns; it refuses to write
	// a Secret without it.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedByAgent = "tokenbroker-agent"

	AnnotationLeaseID   = "tokenbroker.io/lease-id"
	AnnotationExpiresAt = "tokenbroker.io/expires-at"
	// AnnotationObtainedAt is when the credential arrived, so that a
	// restarted agent refreshes at the same fraction of its lifetime.
	AnnotationObtainedAt = "tokenbroker.io/obtained-at"
	// AnnotationTarget names the target that wrote the Secret.
	AnnotationTarget = "tokenbroker.io/target"
	// AnnotationRequest is a digest of the broker URL and the request, so
	// that a restarted agent whose target now asks for something else
	// (another ServiceAccount, say) does not adopt the old credential.
	AnnotationRequest = "tokenbroker.io/request"

	labelArgoCDSecretType = "argocd.argoproj.io/secret-type"
	labelFluxWatch        = "reconcile.fluxcd.io/watch"
)

// The data keys of the Secret formats.
const (
	keyAdmiralty  = "config"     // Admiralty's Target spec.kubeconfigSecret default key
	keyFlux       = "value"      // Flux's kubeConfig.secretRef default key
	keyKubeconfig = "kubeconfig" // the plain format
	keyArgoName   = "name"
	keyArgoServer = "server"
	keyArgoConfig = "config"
)

// metaSuffix names the sidecar file next to a file output that records the
// lease, as the annotations do for a Secret.
const metaSuffix = ".meta"

// ErrForeignSecret is returned (wrapped) when an output's Secret exists but
// was not written by the agent (no app.kubernetes.io/managed-by:
// tokenbroker-agent label). The agent never takes such a Secret over:
// delete it, or label it, to hand it to the agent. Not retryable by itself.
var ErrForeignSecret = errors.New("the Secret exists and is not managed by tokenbroker-agent")

// writeResult is the outcome of writing one output, also the result label
// of tokenbroker_agent_output_writes_total.
type writeResult string

const (
	resultWritten   writeResult = "written"
	resultUnchanged writeResult = "unchanged"
	resultFailed    writeResult = "failed"
)

// stored is a credential an output already holds.
type stored struct {
	grant
	target  string
	request string
	// kubeconfig is nil when the format does not hold a whole kubeconfig
	// (argocd).
	kubeconfig []byte
}

// output is one place a credential is written.
type output interface {
	// String names the output in logs and metrics: "secret:ns/name" or
	// "file:/path".
	String() string
	// write renders c and writes it unless the output already holds
	// exactly that; it reports whether it wrote.
	write(ctx context.Context, meta outputMeta, c *Credential) (bool, error)
	// read returns what the output holds, or nil if it holds nothing the
	// agent wrote.
	read(ctx context.Context) (*stored, error)
}

// outputMeta is what the agent records next to a credential.
type outputMeta struct {
	target  string
	request string
}

// requestDigest identifies what a target asks for: its broker and its
// request.
func requestDigest(brokerURL string, req RequestConfig) string {
	b, _ := json.Marshal(struct {
		Broker  string        `json:"broker"`
		Request RequestConfig `json:"request"`
	}{brokerURL, req}) // cannot fail: strings only
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:8])
}

// argoClusterConfig is the "config" key of an Argo CD cluster Secret: a
// subset of Argo CD's ClusterConfig, whose caData is []byte in Go and so
// base64 of the PEM bundle in JSON.
type argoClusterConfig struct {
	BearerToken     string        `json:"bearerToken"`
	TLSClientConfig argoTLSConfig `json:"tlsClientConfig"`
}

type argoTLSConfig struct {
	Insecure bool   `json:"insecure"`
	CAData   string `json:"caData,omitempty"`
}

// renderSecret returns the Secret an output should hold for c.
func renderSecret(o SecretOutput, meta outputMeta, c *Credential) (*corev1.Secret, error) {
	labels := map[string]string{}
	maps.Copy(labels, o.Labels)
	labels[LabelManagedBy] = ManagedByAgent
	annotations := map[string]string{}
	maps.Copy(annotations, o.Annotations)
	annotations[AnnotationLeaseID] = c.LeaseID
	annotations[AnnotationExpiresAt] = c.ExpiresAt.UTC().Format(time.RFC3339)
	annotations[AnnotationObtainedAt] = c.ObtainedAt.UTC().Format(time.RFC3339)
	annotations[AnnotationTarget] = meta.target
	annotations[AnnotationRequest] = meta.request

	data := map[string][]byte{}
	switch o.Format {
	case FormatAdmiralty:
		data[keyAdmiralty] = c.Kubeconfig
	case FormatFlux:
		data[keyFlux] = c.Kubeconfig
		labels[labelFluxWatch] = "Enabled"
	case FormatKubeconfig:
		data[keyKubeconfig] = c.Kubeconfig
	case FormatArgoCD:
		if c.Token == "" || c.Server == "" {
			return nil, errors.New("the argocd format needs a server and a bearer token")
		}
		cfg := argoClusterConfig{BearerToken: c.Token}
		if len(c.CAData) > 0 {
			cfg.TLSClientConfig.CAData = base64.StdEncoding.EncodeToString(c.CAData)
		}
		js, err := json.Marshal(cfg)
		if err != nil {
			return nil, fmt.Errorf("render argocd config: %w", err)
		}
		data[keyArgoName] = []byte(meta.target)
		data[keyArgoServer] = []byte(c.Server)
		data[keyArgoConfig] = js
		labels[labelArgoCDSecretType] = "cluster"
	default:
		return nil, fmt.Errorf("unknown Secret format %q", o.Format)
	}
	return &corev1.Secret{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{
			Namespace:   o.Namespace,
			Name:        o.Name,
			Labels:      labels,
			Annotations: annotations,
		},
		Type: corev1.SecretTypeOpaque,
		Data: data,
	}, nil
}

// secretOutput is a Secret in the source cluster.
type secretOutput struct {
	cfg     SecretOutput
	secrets corev1client.SecretsGetter
}

var _ output = (*secretOutput)(nil)

func (o *secretOutput) String() string { return "secret:" + o.cfg.Namespace + "/" + o.cfg.Name }

func (o *secretOutput) write(ctx context.Context, meta outputMeta, c *Credential) (bool, error) {
	want, err := renderSecret(o.cfg, meta, c)
	if err != nil {
		return false, err
	}
	api := o.secrets.Secrets(o.cfg.Namespace)
	cur, err := api.Get(ctx, o.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, err := api.Create(ctx, want, metav1.CreateOptions{}); err != nil {
			return false, fmt.Errorf("create Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
		}
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("get Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
	}
	if cur.Labels[LabelManagedBy] != ManagedByAgent {
		return false, fmt.Errorf("Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, ErrForeignSecret)
	}
	if cur.Type != want.Type {
		return false, fmt.Errorf("Secret %s/%s has type %s, not %s; delete it so that the agent can make it again", o.cfg.Namespace, o.cfg.Name, cur.Type, want.Type)
	}
	if upToDate(cur, want) {
		return false, nil
	}
	// Labels and annotations that others added stay; data is the agent's.
	upd := cur.DeepCopy()
	upd.Data = want.Data
	upd.StringData = nil
	if upd.Labels == nil {
		upd.Labels = map[string]string{}
	}
	maps.Copy(upd.Labels, want.Labels)
	if upd.Annotations == nil {
		upd.Annotations = map[string]string{}
	}
	maps.Copy(upd.Annotations, want.Annotations)
	if _, err := api.Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return false, fmt.Errorf("update Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
	}
	return true, nil
}

// upToDate reports whether cur holds exactly want's data and carries want's
// labels and annotations. Consumers such as Admiralty restart on every
// change of the Secret, so an identical write must never happen.
func upToDate(cur, want *corev1.Secret) bool {
	if len(cur.Data) != len(want.Data) {
		return false
	}
	for k, v := range want.Data {
		if got, ok := cur.Data[k]; !ok || !bytes.Equal(got, v) {
			return false
		}
	}
	for k, v := range want.Labels {
		if got, ok := cur.Labels[k]; !ok || got != v {
			return false
		}
	}
	for k, v := range want.Annotations {
		if got, ok := cur.Annotations[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (o *secretOutput) read(ctx context.Context) (*stored, error) {
	s, err := o.secrets.Secrets(o.cfg.Namespace).Get(ctx, o.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
	}
	if s.Labels[LabelManagedBy] != ManagedByAgent {
		return nil, fmt.Errorf("Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, ErrForeignSecret)
	}
	st, err := parseStored(s.Annotations[AnnotationLeaseID], s.Annotations[AnnotationExpiresAt], s.Annotations[AnnotationObtainedAt])
	if err != nil || st == nil {
		return nil, err
	}
	st.target = s.Annotations[AnnotationTarget]
	st.request = s.Annotations[AnnotationRequest]
	switch o.cfg.Format {
	case FormatAdmiralty:
		st.kubeconfig = s.Data[keyAdmiralty]
	case FormatFlux:
		st.kubeconfig = s.Data[keyFlux]
	case FormatKubeconfig:
		st.kubeconfig = s.Data[keyKubeconfig]
	}
	return st, nil
}

// parseStored reads a recorded lease; nil without a lease id.
func parseStored(leaseID, expiresAt, obtainedAt string) (*stored, error) {
	if leaseID == "" {
		return nil, nil
	}
	if !broker.ValidLeaseID(leaseID) {
		return nil, fmt.Errorf("recorded lease id %q is not a lease id", leaseID)
	}
	exp, err := time.Parse(time.RFC3339, expiresAt)
	if err != nil {
		return nil, fmt.Errorf("recorded expiry of lease %s: %w", leaseID, err)
	}
	st := &stored{grant: grant{leaseID: leaseID, expiresAt: exp}}
	if t, err := time.Parse(time.RFC3339, obtainedAt); err == nil {
		st.obtainedAt = t
	}
	return st, nil
}

// fileOutput is a kubeconfig file, with a sidecar PATH.meta (JSON, no
// secret in it) recording the lease. The kubeconfig is written first, so
// that a crash in between leaves a record of the older lease, never one
// that promises more than the file holds.
type fileOutput struct {
	path string
}

var _ output = (*fileOutput)(nil)

// fileMeta is the content of the .meta sidecar file.
type fileMeta struct {
	Target     string    `json:"target"`
	Request    string    `json:"request"`
	LeaseID    string    `json:"leaseId"`
	ObtainedAt time.Time `json:"obtainedAt"`
	ExpiresAt  time.Time `json:"expiresAt"`
}

func (o *fileOutput) String() string { return "file:" + o.path }

func renderFileMeta(meta outputMeta, c *Credential) []byte {
	b, _ := json.MarshalIndent(fileMeta{ // cannot fail: plain fields
		Target:     meta.target,
		Request:    meta.request,
		LeaseID:    c.LeaseID,
		ObtainedAt: c.ObtainedAt.UTC(),
		ExpiresAt:  c.ExpiresAt.UTC(),
	}, "", "  ")
	return append(b, '\n')
}

func (o *fileOutput) write(_ context.Context, meta outputMeta, c *Credential) (bool, error) {
	wroteConfig, err := WriteKubeconfigFile(o.path, c.Kubeconfig)
	if err != nil {
		return false, err
	}
	wroteMeta, err := writeFileIfChanged(o.path+metaSuffix, renderFileMeta(meta, c), 0o600)
	if err != nil {
		return wroteConfig, err
	}
	return wroteConfig || wroteMeta, nil
}

func (o *fileOutput) read(context.Context) (*stored, error) {
	raw, _, err := readFileBounded(o.path+metaSuffix, maxOutputFileBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var m fileMeta
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("%s%s: %w", o.path, metaSuffix, err)
	}
	kc, _, err := readFileBounded(o.path, maxOutputFileBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if m.LeaseID == "" || !broker.ValidLeaseID(m.LeaseID) {
		return nil, fmt.Errorf("%s%s: no valid lease id", o.path, metaSuffix)
	}
	return &stored{
		grant:      grant{leaseID: m.LeaseID, obtainedAt: m.ObtainedAt, expiresAt: m.ExpiresAt},
		target:     m.Target,
		request:    m.Request,
		kubeconfig: kc,
	}, nil
}
