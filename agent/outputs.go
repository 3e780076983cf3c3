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
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/agent/execcred"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// secretDigest identifies a Secret output's settings (AnnotationOutput).
func secretDigest(o config.SecretOutput) string { return shortDigest(o) }

// ErrForeignSecret is returned (wrapped) when an output's Secret exists but
// was not written by the agent (no app.kubernetes.io/managed-by:
// tokenbroker-agent label) and the output does not say adopt: true. The
// agent never takes such a Secret over by itself. Not retryable by itself.
var ErrForeignSecret = errors.New("the Secret exists and is not managed by tokenbroker-agent (set adopt: true on the output to take it over and keep its other keys, or delete it)")

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
	// outdated means the output holds the lease but was written under
	// other settings (another key, labels, Argo CD options): it must be
	// written again, not adopted as it is.
	outdated bool
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

// holdsCredential reports whether an output holds the credential it is
// written with; one that only names how to get it (Argo CD's exec mode)
// does not, and its lease can be revoked as soon as it is written.
func holdsCredential(o output) bool {
	switch o := o.(type) {
	case *secretOutput:
		return execMode(o.cfg.ArgoCD) == nil
	case *clusterProfileOutput:
		return false
	}
	return true
}

// outputMeta is what the agent records next to a credential, and the
// target's broker and request, for outputs that run the plugin with them.
type outputMeta struct {
	target  string
	request string
	broker  string
	req     config.RequestConfig
}

// The data keys of the argocd format.
const (
	keyArgoName       = "name"
	keyArgoServer     = "server"
	keyArgoConfig     = "config"
	keyArgoProject    = "project"
	keyArgoNamespaces = "namespaces"
	keyArgoClusterRes = "clusterResources"
	keyArgoShard      = "shard"
)

// execMode is the Argo CD exec mode of a, nil when off.
func execMode(a *config.ArgoCDOptions) *config.ArgoCDExec {
	if a == nil {
		return nil
	}
	return a.Exec
}

// requestDigest identifies what a target asks for: its broker and its
// request.
func requestDigest(brokerURL string, req config.RequestConfig) string {
	return shortDigest(struct {
		Broker  string               `json:"broker"`
		Request config.RequestConfig `json:"request"`
	}{brokerURL, req})
}

// shortDigest is "sha256:" and 16 hex digits of v's JSON: enough to tell
// settings apart in an annotation, not a security boundary. v holds only
// strings, bools, numbers, slices and maps of them, so it always marshals.
func shortDigest(v any) string {
	b, _ := json.Marshal(v)
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:8])
}

// argoClusterConfig is the "config" key of an Argo CD cluster Secret: a
// subset of Argo CD's ClusterConfig, whose caData is []byte in Go and so
// base64 of the PEM bundle in JSON.
type argoClusterConfig struct {
	BearerToken        string            `json:"bearerToken,omitempty"`
	TLSClientConfig    argoTLSConfig     `json:"tlsClientConfig"`
	ProxyURL           string            `json:"proxyUrl,omitempty"`
	ExecProviderConfig *argoExecProvider `json:"execProviderConfig,omitempty"`
}

// argoExecProvider is Argo CD's ExecProviderConfig, which its
// Cluster.RESTConfig turns into a client-go exec provider that is never
// interactive.
type argoExecProvider struct {
	Command     string            `json:"command"`
	Args        []string          `json:"args"`
	Env         map[string]string `json:"env,omitempty"`
	APIVersion  string            `json:"apiVersion"`
	InstallHint string            `json:"installHint,omitempty"`
}

type argoTLSConfig struct {
	Insecure   bool   `json:"insecure"`
	ServerName string `json:"serverName,omitempty"`
	CAData     string `json:"caData,omitempty"`
	// CertData and KeyData are a client certificate credential: base64
	// of the PEM, as Argo CD's []byte fields are in JSON.
	CertData string `json:"certData,omitempty"`
	KeyData  string `json:"keyData,omitempty"`
}

// ownedKeys is the content of the tokenbroker.io/owned annotation.
type ownedKeys struct {
	Data        []string `json:"data"`
	Labels      []string `json:"labels"`
	Annotations []string `json:"annotations"`
}

// ownedBy lists the keys of s, which holds only what the agent writes.
func ownedBy(s *corev1.Secret) ownedKeys {
	return ownedKeys{
		Data:        slices.Sorted(maps.Keys(s.Data)),
		Labels:      slices.Sorted(maps.Keys(s.Labels)),
		Annotations: slices.Sorted(maps.Keys(s.Annotations)),
	}
}

// ownedFrom reads the record of what the agent wrote to s; a missing or
// unreadable record owns nothing beyond what the agent writes now.
func ownedFrom(s *corev1.Secret) ownedKeys {
	var o ownedKeys
	if raw := s.Annotations[config.AnnotationOwned]; raw != "" {
		_ = json.Unmarshal([]byte(raw), &o) // a bad record owns nothing
	}
	return o
}

// renderArgoCD fills the keys of an Argo CD cluster Secret.
func renderArgoCD(o config.SecretOutput, meta outputMeta, c *Credential, data map[string][]byte) error {
	if c.Token == "" && len(c.CertData) == 0 || c.Server == "" {
		return errors.New("the argocd format needs a server and a bearer token or a client certificate")
	}
	cfg := argoClusterConfig{BearerToken: c.Token, ProxyURL: c.ProxyURL}
	if e := execMode(o.ArgoCD); e != nil {
		// No credential: Argo CD runs the plugin, which asks the broker
		// with the same request as this target.
		ec := execcred.ExecConfig(e.Command, execcred.Target{
			Broker: meta.broker, IdentityDir: e.IdentityDir, RequestSpec: apiv1.RequestSpec(meta.req),
		})
		cfg = argoClusterConfig{ProxyURL: c.ProxyURL, ExecProviderConfig: &argoExecProvider{
			Command: ec.Command, Args: ec.Args, Env: e.Env, APIVersion: ec.APIVersion, InstallHint: ec.InstallHint,
		}}
	} else if len(c.CertData) > 0 {
		cfg.TLSClientConfig.CertData = base64.StdEncoding.EncodeToString(c.CertData)
		cfg.TLSClientConfig.KeyData = base64.StdEncoding.EncodeToString(c.KeyData)
	}
	cfg.TLSClientConfig.ServerName = c.TLSServerName
	if len(c.CAData) > 0 {
		cfg.TLSClientConfig.CAData = base64.StdEncoding.EncodeToString(c.CAData)
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("render argocd config: %w", err)
	}
	data[keyArgoName] = []byte(meta.target)
	data[keyArgoServer] = []byte(c.Server)
	data[keyArgoConfig] = js
	a := o.ArgoCD
	if a == nil {
		return nil
	}
	if a.Name != "" {
		data[keyArgoName] = []byte(a.Name)
	}
	if a.Project != "" {
		data[keyArgoProject] = []byte(a.Project)
	}
	if len(a.Namespaces) > 0 {
		data[keyArgoNamespaces] = []byte(strings.Join(a.Namespaces, ","))
	}
	if a.ClusterResources != nil {
		data[keyArgoClusterRes] = []byte(strconv.FormatBool(*a.ClusterResources))
	}
	if a.Shard != nil {
		data[keyArgoShard] = []byte(strconv.FormatInt(*a.Shard, 10))
	}
	return nil
}

// renderSecret returns what the agent owns of the Secret an output
// should hold for c: its data keys, labels and annotations, with the
// tokenbroker.io/owned record of them.
func renderSecret(o config.SecretOutput, meta outputMeta, c *Credential) (*corev1.Secret, error) {
	labels := map[string]string{}
	maps.Copy(labels, o.Labels)
	labels[config.LabelManagedBy] = config.ManagedByAgent
	annotations := map[string]string{}
	maps.Copy(annotations, o.Annotations)
	annotations[config.AnnotationLeaseID] = c.LeaseID
	annotations[config.AnnotationExpiresAt] = c.ExpiresAt.UTC().Format(time.RFC3339)
	annotations[config.AnnotationObtainedAt] = c.ObtainedAt.UTC().Format(time.RFC3339)
	annotations[config.AnnotationTarget] = meta.target
	annotations[config.AnnotationRequest] = meta.request
	annotations[config.AnnotationOutput] = secretDigest(o)

	data := map[string][]byte{}
	switch o.Format {
	case config.FormatAdmiralty, config.FormatFlux, config.FormatKubeconfig:
		data[o.DataKey()] = c.Kubeconfig
	case config.FormatMultiKueue:
		// Kueue (v0.15+) refuses a kubeconfig without inline CA data, or
		// with anything but an inline token or client certificate; say so
		// here rather than as a MultiKueueCluster that never gets Active.
		if len(c.CAData) == 0 || c.Token == "" && len(c.CertData) == 0 {
			return nil, errors.New("the multikueue format needs the kubeconfig's certificate-authority-data and an inline token or client certificate")
		}
		data[config.KeyKubeconfig] = c.Kubeconfig
	case config.FormatArgoCD:
		if err := renderArgoCD(o, meta, c, data); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("unknown Secret format %q", o.Format)
	}
	maps.Copy(labels, config.FormatLabels(o.Format))
	s := &corev1.Secret{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{
			Namespace:   o.Namespace,
			Name:        o.Name,
			Labels:      labels,
			Annotations: annotations,
		},
		Type: corev1.SecretTypeOpaque,
		Data: data,
	}
	owned, _ := json.Marshal(ownedBy(s)) // cannot fail: strings only
	annotations[config.AnnotationOwned] = string(owned)
	return s, nil
}

// secretOutput is a Secret in the source cluster.
type secretOutput struct {
	cfg     config.SecretOutput
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
	if cur.Labels[config.LabelManagedBy] != config.ManagedByAgent && !o.cfg.Adopt {
		return false, fmt.Errorf("Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, ErrForeignSecret)
	}
	if cur.Type != want.Type {
		return false, fmt.Errorf("Secret %s/%s has type %s, not %s; delete it so that the agent can make it again", o.cfg.Namespace, o.cfg.Name, cur.Type, want.Type)
	}
	upd, changed := merge(cur, want)
	if !changed {
		return false, nil
	}
	if _, err := api.Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		return false, fmt.Errorf("update Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
	}
	return true, nil
}

// merge returns cur with what the agent owns replaced by want: want's data
// keys, labels and annotations set, and those the agent wrote before
// (cur's owned record) but no longer writes removed. Every other key is
// left as it is. changed is false when cur already holds exactly that:
// consumers such as Admiralty restart on every change of the Secret, so an
// identical write must never happen.
func merge(cur, want *corev1.Secret) (upd *corev1.Secret, changed bool) {
	prev := ownedFrom(cur)
	upd = cur.DeepCopy()
	upd.StringData = nil
	same := func(a, b string) bool { return a == b }
	var labels, annotations bool
	upd.Data, changed = mergeMap(upd.Data, want.Data, prev.Data, bytes.Equal)
	upd.Labels, labels = mergeMap(upd.Labels, want.Labels, prev.Labels, same)
	upd.Annotations, annotations = mergeMap(upd.Annotations, want.Annotations, prev.Annotations, same)
	return upd, changed || labels || annotations
}

// mergeMap sets want's entries in m and deletes the keys of prevOwned that
// want lacks; it reports whether m changed.
func mergeMap[V any](m, want map[string]V, prevOwned []string, equal func(a, b V) bool) (map[string]V, bool) {
	if m == nil {
		m = map[string]V{}
	}
	changed := false
	for _, k := range prevOwned {
		if _, keep := want[k]; keep {
			continue
		}
		if _, ok := m[k]; ok {
			delete(m, k)
			changed = true
		}
	}
	for k, v := range want {
		if got, ok := m[k]; !ok || !equal(got, v) {
			m[k] = v
			changed = true
		}
	}
	return m, changed
}

func (o *secretOutput) read(ctx context.Context) (*stored, error) {
	s, err := o.secrets.Secrets(o.cfg.Namespace).Get(ctx, o.cfg.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, err)
	}
	if s.Labels[config.LabelManagedBy] != config.ManagedByAgent {
		if o.cfg.Adopt {
			return nil, nil // nothing the agent wrote, yet
		}
		return nil, fmt.Errorf("Secret %s/%s: %w", o.cfg.Namespace, o.cfg.Name, ErrForeignSecret)
	}
	st, err := parseStored(s.Annotations[config.AnnotationLeaseID], s.Annotations[config.AnnotationExpiresAt], s.Annotations[config.AnnotationObtainedAt])
	if err != nil || st == nil {
		return nil, err
	}
	st.target = s.Annotations[config.AnnotationTarget]
	st.request = s.Annotations[config.AnnotationRequest]
	st.outdated = s.Annotations[config.AnnotationOutput] != secretDigest(o.cfg)
	if key := o.cfg.DataKey(); key != "" {
		st.kubeconfig = s.Data[key]
	}
	return st, nil
}

// parseStored reads a recorded lease; nil without a lease id.
func parseStored(leaseID, expiresAt, obtainedAt string) (*stored, error) {
	if leaseID == "" {
		return nil, nil
	}
	if !apiv1.ValidLeaseID(leaseID) {
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
// secret in it) recording the lease, and with tokenFile a token file
// beside it. The credential is written first (the token file, then the
// kubeconfig), the record last, so that a crash in between leaves a
// record of the older lease, never one that promises more than the files
// hold.
type fileOutput struct {
	cfg config.FileOutput
}

var _ output = (*fileOutput)(nil)

// fileMeta is the content of the .meta sidecar file.
type fileMeta struct {
	Target     string    `json:"target"`
	Request    string    `json:"request"`
	LeaseID    string    `json:"leaseId"`
	ObtainedAt time.Time `json:"obtainedAt"`
	ExpiresAt  time.Time `json:"expiresAt"`
	// Output is the digest of the output's settings; absent in records
	// written before token files, which had none.
	Output string `json:"output,omitempty"`
}

func (o *fileOutput) String() string { return "file:" + o.cfg.Path }

func (o *fileOutput) digest() string {
	if o.cfg.TokenFile == "" {
		return "" // as the records written before token files
	}
	return shortDigest(o.cfg)
}

func (o *fileOutput) tokenPath() string {
	return filepath.Join(filepath.Dir(o.cfg.Path), o.cfg.TokenFile)
}

func (o *fileOutput) renderMeta(meta outputMeta, c *Credential) []byte {
	b, _ := json.MarshalIndent(fileMeta{ // cannot fail: plain fields
		Target:     meta.target,
		Request:    meta.request,
		LeaseID:    c.LeaseID,
		ObtainedAt: c.ObtainedAt.UTC(),
		ExpiresAt:  c.ExpiresAt.UTC(),
		Output:     o.digest(),
	}, "", "  ")
	return append(b, '\n')
}

func (o *fileOutput) write(_ context.Context, meta outputMeta, c *Credential) (bool, error) {
	kubeconfig := c.Kubeconfig
	wroteToken := false
	if o.cfg.TokenFile != "" {
		if c.Token == "" {
			return false, errors.New("a token file output needs a token, and the credential is a client certificate")
		}
		kc, err := withTokenFile(c.Kubeconfig, o.cfg.TokenFile)
		if err != nil {
			return false, err
		}
		// The token before the kubeconfig that names its file, so that a
		// reader never finds a kubeconfig pointing at nothing.
		if wroteToken, err = writeFileIfChanged(o.tokenPath(), []byte(c.Token), 0o600); err != nil {
			return false, err
		}
		kubeconfig = kc
	}
	wroteConfig, err := WriteKubeconfigFile(o.cfg.Path, kubeconfig)
	if err != nil {
		return wroteToken, err
	}
	wroteMeta, err := writeFileIfChanged(o.cfg.Path+config.MetaSuffix, o.renderMeta(meta, c), 0o600)
	if err != nil {
		return wroteToken || wroteConfig, err
	}
	return wroteToken || wroteConfig || wroteMeta, nil
}

// withTokenFile rewrites a kubeconfig so that its current user reads its
// token from the file name (relative: clientcmd resolves it against the
// kubeconfig's directory) instead of holding it. The result depends only
// on the cluster entry and the names, never on the token, so it changes
// only when they do. Errors never quote the document.
func withTokenFile(data []byte, name string) ([]byte, error) {
	return editCurrentUser(data, func(user *clientcmdapi.AuthInfo) error {
		if user.Token == "" {
			return errors.New("the kubeconfig's user has no token")
		}
		user.Token, user.TokenFile = "", name
		return nil
	})
}

// withToken is withTokenFile undone: the kubeconfig of a token file
// output with the token put back, as the broker sent it (but for YAML
// formatting), so that recovery can write it to other outputs.
func withToken(data []byte, token string) ([]byte, error) {
	return editCurrentUser(data, func(user *clientcmdapi.AuthInfo) error {
		if user.TokenFile == "" {
			return errors.New("the kubeconfig's user has no token file")
		}
		user.Token, user.TokenFile = token, ""
		return nil
	})
}

func (o *fileOutput) read(context.Context) (*stored, error) {
	raw, _, err := pki.ReadFileLimitStat(o.cfg.Path+config.MetaSuffix, maxOutputFileBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var m fileMeta
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("%s%s: %w", o.cfg.Path, config.MetaSuffix, err)
	}
	kc, _, err := pki.ReadFileLimitStat(o.cfg.Path, maxOutputFileBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if m.LeaseID == "" || !apiv1.ValidLeaseID(m.LeaseID) {
		return nil, fmt.Errorf("%s%s: no valid lease id", o.cfg.Path, config.MetaSuffix)
	}
	st := &stored{
		grant:      grant{leaseID: m.LeaseID, obtainedAt: m.ObtainedAt, expiresAt: m.ExpiresAt},
		target:     m.Target,
		request:    m.Request,
		kubeconfig: kc,
		outdated:   m.Output != o.digest(),
	}
	if o.cfg.TokenFile != "" && !st.outdated {
		tok, _, err := pki.ReadFileLimitStat(o.tokenPath(), maxOutputFileBytes)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		// A kubeconfig that cannot take the token back is still the
		// lease's: it is rewritten, with a new credential if need be.
		st.kubeconfig, _ = withToken(kc, strings.TrimSpace(string(tok)))
	}
	return st, nil
}
